"""The router's Lua module ``dscache_router``: bounded-load balancer and request counters.

Text, not logic (its length is the Lua's). :mod:`.render` puts it in
``init_by_lua_block`` with ``@CONFIG@`` replaced by a Lua table literal built
from the validated :class:`~dscache_operator.nginx.config.RouterConfig`
(addresses, factor, metric names); the module registers itself in
``package.loaded``, so each phase reaches it with ``require("dscache_router")``.

State lives in the ``dscache_router`` shared dict, shared by the workers and
kept across reloads (counters stay monotonic): ``inflight:<pod>`` (tries in
progress), ``down:<pod>`` (failed within ``fail_timeout`` seconds; expires on
its own), and the counters ``requests:<track>:<class>``, ``retries:<track>``,
``tries:<pod>``, ``errors:<pod>``, ``skips:<pod>``.

A real session (a client's own id: its header or cookie) is pinned: the pod that
served it is remembered in the ``dscache_pins`` shared dict (``<upstream> \\0 <key>``,
``pin_ttl`` seconds after its last request) and takes its next requests whatever
its load, as long as it is up: that pod holds the session's KV, and moving the
session would recompute its whole history. Only new sessions, prompt-keyed
requests and retries are placed by the bounded walk below (and a session is pinned
where that walk put it). A prompt key is never pinned: the opening it stands for
is worth caching on several pods, and spreading it is the point.

``balance(upstream)`` (``balancer_by_lua``): the pods in NGINX's own
``hash ... consistent`` ring order from the key's point (160 points a pod,
``crc32(HOST \\0 PORT PREV_HASH)``, as ``ngx_http_upstream_hash_module`` builds
it, so with no load it picks exactly the pod NGINX would), skipping pods tried
by this request or down, and, with a factor, pods whose in-flight count is not
below ``ceil(factor * (in-flight of the track + 1) / live pods)``. No eligible
pod under the bound: the first eligible one; none eligible at all: the first
untried one (better a try than a certain 502). A retry marks the failed pod
down and ends its in-flight count; ``log()`` ends the last one (and marks its
pod down when it failed: no answer, 502, 503 or 504, as ``max_fails=1`` does).

``pick(upstream)`` (``access_by_lua``, with a picker configured): asks the
picker (:mod:`dscache_server.picker`) through the internal ``picker_path``
subrequest which pod holds the longest cached prefix of the request; the
balancer's first try takes that pod when it is in the track and up (the picker
applied the load bound from the in-flight counts it was sent). No answer within
the timeout, or a wrong one: the walk below, as without a picker.

Router replicas agree through the pods (:mod:`dscache_server.sessions`). A
session (header or cookie) this replica has neither a track nor a pin for is
looked up once per request: ``locate(key)`` asks the picker, which asks every
live pod of every track whether it served the session, through the internal
``locate_path`` subrequest; the pod that did gives the session its track (the
session memory takes it) and its pin, so a session stays where its KV is
whichever replica it reaches, across weight changes, replica restarts and
scale-out. No answer in time, or no pod that knows it: placed as before.
``report()`` (``header_filter_by_lua``) keeps each pod's own in-flight count,
``X-Dscache-Inflight`` on its answers, for ``report_ttl`` seconds as
``reported:<pod>``; a pod's load is the larger of this replica's count and the
pod's report, so the bound sees what the other replicas sent.

``log()`` (``log_by_lua``, every proxied request) also counts the request by
track role and status class, its retries, and each try by pod from
``$upstream_addr`` / ``$upstream_status`` (so the counters work without the
balancer too; a pod label is only ever a configured address).
``metrics()`` serves them in Prometheus' text format.
"""

LUA_ROUTER = """\
    init_by_lua_block {
        local config = @CONFIG@
        local dict = ngx.shared.dscache_router
        local pins = ngx.shared.dscache_pins
        local floor, ceil = math.floor, math.ceil
        local M = {}

        local function le32(h)
            return string.char(h % 256, floor(h / 256) % 256, floor(h / 65536) % 256,
                               floor(h / 16777216) % 256)
        end

        local function ring(pods)
            local points, hashes, owners = {}, {}, {}
            for _, pod in ipairs(pods) do
                local host, port = string.match(pod, "^(.*):(%d+)$")
                local base, prev = host .. "\\0" .. port, 0
                for _ = 1, 160 do
                    prev = ngx.crc32_long(base .. le32(prev))
                    points[#points + 1] = {prev, pod}
                end
            end
            table.sort(points, function(a, b) return a[1] < b[1] end)
            for _, p in ipairs(points) do
                if p[1] ~= hashes[#hashes] then
                    hashes[#hashes + 1], owners[#owners + 1] = p[1], p[2]
                end
            end
            local has = {}
            for _, pod in ipairs(pods) do has[pod] = true end
            return {pods = pods, hashes = hashes, owners = owners, has = has}
        end

        local rings, peers = {}, {}
        for name, pods in pairs(config.upstreams) do
            rings[name] = ring(pods)
        end
        for _, pod in ipairs(config.pods) do
            local host, port = string.match(pod, "^(.*):(%d+)$")
            peers[pod] = {string.gsub(host, "^%[(.*)%]$", "%1"), tonumber(port)}
        end

        -- The ring's pods in order from the key's point (the first hash >= the key's).
        local function walk(r, key)
            local hashes, owners, n = r.hashes, r.owners, #r.hashes
            local h, lo, hi = ngx.crc32_long(key), 1, n
            if h > hashes[n] then
                lo = 1
            else
                while lo < hi do
                    local mid = floor((lo + hi) / 2)
                    if hashes[mid] < h then lo = mid + 1 else hi = mid end
                end
            end
            local order, seen = {}, {}
            for _ = 1, n do
                local pod = owners[lo]
                if not seen[pod] then
                    seen[pod] = true
                    order[#order + 1] = pod
                    if #order == #r.pods then break end
                end
                lo = lo % n + 1
            end
            return order
        end

        -- A pod's load: this replica's tries on it, or the pod's own recent report of
        -- all its requests (every replica's), whichever is larger.
        local function inflight(pod)
            local v = dict:get("inflight:" .. pod) or 0
            local reported = dict:get("reported:" .. pod) or 0
            if reported > v then v = reported end
            return v > 0 and v or 0
        end

        local function choose(r, state)
            local total, live = 0, 0
            for _, pod in ipairs(r.pods) do
                total = total + inflight(pod)
                if not dict:get("down:" .. pod) then live = live + 1 end
            end
            local cap = nil
            if config.factor > 0 then
                cap = ceil(config.factor * (total + 1) / math.max(live, 1))
            end
            local order = walk(r, ngx.var.dscache_key)
            local first
            for _, pod in ipairs(order) do
                if not state.tried[pod] and not dict:get("down:" .. pod) then
                    if cap == nil or inflight(pod) < cap then
                        return pod
                    end
                    first = first or pod
                    dict:incr("skips:" .. pod, 1, 0)
                end
            end
            if first then return first end
            for _, pod in ipairs(order) do
                if not state.tried[pod] then return pod end
            end
            return order[1]
        end

        function M.balance(name)
            local balancer = require "ngx.balancer"
            local r = rings[name]
            local state = ngx.ctx.dscache_router
            if state == nil then
                state = {tried = {}}
                ngx.ctx.dscache_router = state
                if #r.pods > 1 then balancer.set_more_tries(#r.pods - 1) end
            elseif state.last then
                -- A retry: the last try failed (error, timeout, 502, 503).
                dict:set("down:" .. state.last, true, config.fail_timeout)
                dict:incr("inflight:" .. state.last, -1, 1)
                state.last = nil
            end
            local key = ngx.var.dscache_key
            local source = ngx.var.dscache_key_source
            local pinned = (source == "header" or source == "cookie") and pins ~= nil
            local pin = pinned and (name .. "\0" .. key) or nil
            local pod = pin and pins:get(pin) or nil
            if pod and (not r.has[pod] or state.tried[pod] or dict:get("down:" .. pod)) then
                pod = nil  -- gone from the track, failed or down: placed anew
            end
            if not pod and next(state.tried) == nil then
                -- The picker's choice (access phase): only for a first try, only if up.
                local picked = ngx.ctx.dscache_pick
                if picked and r.has[picked] and not dict:get("down:" .. picked) then
                    pod = picked
                end
            end
            pod = pod or choose(r, state)
            if pin then
                local ok, err = pins:set(pin, pod, config.pin_ttl)
                if not ok then
                    ngx.log(ngx.WARN, "dscache router: cannot pin a session: ", err)
                end
            end
            state.tried[pod] = true
            state.last = pod
            dict:incr("inflight:" .. pod, 1, 0)
            local ok, err = balancer.set_current_peer(peers[pod][1], peers[pod][2])
            if not ok then
                ngx.log(ngx.ERR, "dscache router: cannot send to ", pod, ": ", err)
            end
        end

        -- Which pod served this session last, and its track (without "dscache_"): asked
        -- of the pods through the picker, once per request; nil, nil when none did, the
        -- key is not a client's session, or the picker did not answer in time.
        function M.locate(key)
            local memo = ngx.ctx.dscache_located
            if memo then return memo[1], memo[2] end
            ngx.ctx.dscache_located = {}
            local source = ngx.var.dscache_key_source
            if not config.picker or (source ~= "header" and source ~= "cookie") then return end
            local parts, owner = {}, {}
            for name, r in pairs(rings) do
                for _, pod in ipairs(r.pods) do
                    if not owner[pod] and not dict:get("down:" .. pod) then
                        owner[pod] = string.sub(name, 9)
                        parts[#parts + 1] = pod
                    end
                end
            end
            if #parts == 0 then return end
            local res = ngx.location.capture(config.locate_path, {
                args = {key = key, pods = table.concat(parts, ","),
                        budget_ms = config.locate_budget_ms}})
            local result = "failed"
            if res and res.status == 404 then
                result = "unknown"
            elseif res and res.status == 200 and owner[res.body] then
                result = "found"
                ngx.ctx.dscache_located = {owner[res.body], res.body}
            end
            dict:incr("locates:" .. result, 1, 0)
            memo = ngx.ctx.dscache_located
            return memo[1], memo[2]
        end

        -- The pod's own in-flight count from its answer (header filter phase).
        function M.report()
            local state = ngx.ctx.dscache_router
            local n = tonumber(ngx.var.upstream_http_x_dscache_inflight or "")
            if state and state.last and n then
                dict:set("reported:" .. state.last, n, config.report_ttl)
            end
        end

        -- Asks the picker (access phase) which pod should take the request: the track's
        -- live pods in ring order with their in-flight counts, the load bound, the key
        -- and the session's pin go as arguments, the body as it came. Any failure (an
        -- error, a timeout, an answer naming no pod of the track): the walk decides.
        local pick_reasons = {pinned = true, prefix = true, similar = true, hash = true,
                              overloaded = true}
        function M.pick(name)
            local r = rings[name]
            if not config.picker or r == nil or #r.pods < 2 then return end
            local key = ngx.var.dscache_key
            local source = ngx.var.dscache_key_source
            local total, live = 0, 0
            for _, pod in ipairs(r.pods) do
                total = total + inflight(pod)
                if not dict:get("down:" .. pod) then live = live + 1 end
            end
            local cap = ceil(config.factor * (total + 1) / math.max(live, 1))
            local parts = {}
            for _, pod in ipairs(walk(r, key)) do
                if not dict:get("down:" .. pod) then
                    parts[#parts + 1] = pod .. "/" .. inflight(pod)
                end
            end
            if #parts == 0 then return end
            local pinned = ""
            if (source == "header" or source == "cookie") and pins ~= nil then
                pinned = pins:get(name .. "\0" .. key) or ""
                if pinned == "" then
                    -- New to this replica: the pod that served it keeps it (see locate).
                    local _, pod = M.locate(key)
                    if pod and r.has[pod] and not dict:get("down:" .. pod) then
                        pins:set(name .. "\0" .. key, pod, config.pin_ttl)
                        return
                    end
                end
            end
            ngx.req.read_body()
            local res = ngx.location.capture(config.picker_path, {
                method = ngx.HTTP_POST, always_forward_body = true,
                args = {pods = table.concat(parts, ","), cap = cap, key = key,
                        source = source, pinned = pinned}})
            if res and res.status == 200 and r.has[res.body] then
                ngx.ctx.dscache_pick = res.body
                local reason = res.header["X-Dscache-Pick-Reason"]
                    or res.header["x-dscache-pick-reason"]
                if not pick_reasons[reason] then reason = "hash" end
                dict:incr("picks:" .. reason, 1, 0)
            else
                dict:incr("picks:failed", 1, 0)
            end
        end

        local known = {}
        for _, pod in ipairs(config.pods) do known[pod] = true end

        local function split(text)
            local out = {}
            for item in string.gmatch(text or "", "[^%s,]+") do
                if item ~= ":" then out[#out + 1] = item end
            end
            return out
        end

        function M.log()
            local addrs = split(ngx.var.upstream_addr)
            local codes = split(ngx.var.upstream_status)
            local state = ngx.ctx.dscache_router
            if state and state.last then
                local code = tonumber(codes[#codes])
                if code == nil or code == 502 or code == 503 or code == 504 then
                    dict:set("down:" .. state.last, true, config.fail_timeout)
                end
                dict:incr("inflight:" .. state.last, -1, 1)
                state.last = nil
            end
            local track = ngx.var.dscache_track or "stable"
            local class = string.sub(ngx.var.status or "0", 1, 1) .. "xx"
            dict:incr("requests:" .. track .. ":" .. class, 1, 0)
            if #addrs > 1 then dict:incr("retries:" .. track, #addrs - 1, 0) end
            for i, addr in ipairs(addrs) do
                if known[addr] then
                    dict:incr("tries:" .. addr, 1, 0)
                    local code = tonumber(codes[i])
                    if code == nil or code >= 500 then dict:incr("errors:" .. addr, 1, 0) end
                end
            end
        end

        function M.metrics()
            local names, out = config.names, {}
            local function family(name, kind, help)
                out[#out + 1] = "# HELP " .. name .. " " .. help
                out[#out + 1] = "# TYPE " .. name .. " " .. kind
            end
            local function sample(name, labels, value)
                out[#out + 1] = string.format("%s%s %s", name, labels, value)
            end
            local function per_pod(name, kind, help, prefix, get)
                family(name, kind, help)
                for _, pod in ipairs(config.pods) do
                    local v = get and get(pod) or dict:get(prefix .. pod) or 0
                    sample(name, '{upstream="' .. pod .. '"}', v)
                end
            end
            family(names.requests, "counter",
                   "Requests the router answered, by track role and status class.")
            for _, track in ipairs(config.tracks) do
                for _, class in ipairs({"1xx", "2xx", "3xx", "4xx", "5xx"}) do
                    local v = dict:get("requests:" .. track .. ":" .. class) or 0
                    sample(names.requests, '{track="' .. track .. '",code="' .. class .. '"}', v)
                end
            end
            family(names.retries, "counter",
                   "Upstream tries beyond the first (a pod failed before the first byte).")
            for _, track in ipairs(config.tracks) do
                sample(names.retries, '{track="' .. track .. '"}',
                       dict:get("retries:" .. track) or 0)
            end
            per_pod(names.tries, "counter", "Tries sent to each pod.", "tries:")
            per_pod(names.errors, "counter",
                    "Tries that ended in a connection error, a timeout or a 5xx.", "errors:")
            per_pod(names.skips, "counter",
                    "Requests that passed a pod over its bounded load.", "skips:")
            if config.balanced then
                per_pod(names.inflight, "gauge",
                        "Requests in progress on each pod: this replica's tries, or the "
                        .. "pod's own recent report if larger (the Lua balancer).", nil,
                        inflight)
            end
            if config.picker then
                family(names.picks, "counter",
                       "Requests placed on the picker's advice, by its reason; failed: the "
                       .. "picker did not answer in time or named no pod of the track.")
                for _, reason in ipairs({"pinned", "prefix", "similar", "hash", "overloaded",
                                         "failed"}) do
                    sample(names.picks, '{reason="' .. reason .. '"}',
                           dict:get("picks:" .. reason) or 0)
                end
                family(names.locates, "counter",
                       "Sessions this replica did not know, looked up on the pods: found (a "
                       .. "pod served it: it stays there), unknown (none did), failed (no "
                       .. "answer in time).")
                for _, result in ipairs({"found", "unknown", "failed"}) do
                    sample(names.locates, '{result="' .. result .. '"}',
                           dict:get("locates:" .. result) or 0)
                end
            end
            family(names.weight, "gauge", "The configured canary weight, percent.")
            sample(names.weight, "", config.canary_weight)
            family(names.factor, "gauge", "The bounded-load factor (0: plain consistent hash).")
            sample(names.factor, "", config.factor)
            ngx.header["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
            ngx.print(table.concat(out, "\\n"), "\\n")
        end

        package.loaded.dscache_router = M
    }"""
