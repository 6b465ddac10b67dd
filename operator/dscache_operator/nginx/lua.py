"""The Lua the router's nginx.conf embeds (needs NGINX's Lua module).

Three blocks, filled in by :mod:`.render`: the prompt key (``%``-format:
``scan``, ``max_bytes``, ``max_messages``), the session memory (``live``,
``ttl``, ``locate``: empty, or :data:`LUA_SESSION_LOCATE` with a picker) and
the config watcher (``@PATH@``, ``@ID@``, ``@INTERVAL@``; kept as placeholders
because Lua's own ``%`` patterns would clash with ``%``-format). This module is
text, not logic: its length is the Lua's.
"""

#: With a picker: a session this replica does not remember takes the track of the pod
#: that served it (``dscache_router.locate``), so router replicas agree.
LUA_SESSION_LOCATE = """
            if remember and not track then
                track = require("dscache_router").locate(key)
            end"""

LUA_SESSION_MEMORY = """            local live = {%(live)s}
            local sessions = ngx.shared.dscache_sessions
            local key = ngx.var.dscache_key
            -- A fresh request id names no session: nothing to remember.
            local remember = ngx.var.dscache_key_source ~= "new"
            local track = remember and sessions:get(key) or nil%(locate)s
            if not track or not live[track] then
                track = ngx.var.dscache_new_track
            end
            ngx.var.dscache_chosen_track = track
            if remember then
                local ok, err = sessions:set(key, track, %(ttl)d)
                if not ok then
                    ngx.log(ngx.WARN, "dscache router: cannot remember a session: ", err)
                end
            end"""


LUA_WATCH = """\
    init_worker_by_lua_block {
        if ngx.worker.id() ~= 0 then
            return
        end
        local ffi = require "ffi"
        pcall(ffi.cdef, "int kill(int pid, int sig); int getppid(void);")
        local path, loaded, signalled = "@PATH@", "@ID@", nil
        local function file_id()
            local f = io.open(path, "rb")
            if not f then
                return nil
            end
            local head = f:read(512)
            f:close()
            return head and string.match(head, "dscache%-config%-id: (%x+)")
        end
        local function check(premature)
            if premature then
                return
            end
            local id = file_id()
            if id and id ~= loaded and id ~= signalled then
                signalled = id
                ngx.log(ngx.NOTICE, "dscache router: ", path, " is now ", id, ", reloading")
                if ffi.C.kill(ffi.C.getppid(), 1) ~= 0 then
                    ngx.log(ngx.ERR, "dscache router: cannot signal the master, errno ",
                            ffi.errno())
                end
            end
        end
        local ok, err = ngx.timer.every(@INTERVAL@, check)
        if not ok then
            ngx.log(ngx.ERR, "dscache router: cannot watch ", path, ": ", err)
        end
    }"""


LUA_PROMPT_KEY = """\
            local function prompt_key()
            if ngx.var.dscache_key_source ~= "new" then
                return
            end
            ngx.req.read_body()
            local body = ngx.req.get_body_data()
            if not body then
                local path = ngx.req.get_body_file()
                if path then
                    local f = io.open(path, "rb")
                    if f then
                        body = f:read(%(scan)d)
                        f:close()
                    end
                end
            end
            if not body or body == "" then
                return
            end
            local max_bytes, max_messages = %(max_bytes)d, %(max_messages)d
            local lead
            local s = string.find(body, '"messages"', 1, true)
            local i = s and string.find(body, "[", s, true)
            if i then
                local limit = math.min(#body, i + max_bytes - 1)
                local depth, in_str, esc, count = 0, false, false, 0
                lead = string.sub(body, i, limit)
                for j = i + 1, limit do
                    local c = string.byte(body, j)
                    if in_str then
                        if esc then
                            esc = false
                        elseif c == 92 then
                            esc = true
                        elseif c == 34 then
                            in_str = false
                        end
                    elseif c == 34 then
                        in_str = true
                    elseif c == 123 or c == 91 then
                        depth = depth + 1
                    elseif c == 125 or c == 93 then
                        if depth == 0 then
                            lead = string.sub(body, i, j - 1)
                            break
                        end
                        depth = depth - 1
                        if depth == 0 then
                            count = count + 1
                            if count >= max_messages then
                                lead = string.sub(body, i, j)
                                break
                            end
                        end
                    end
                end
            else
                local p = string.find(body, '"prompt"', 1, true) or 1
                lead = string.sub(body, p, p + max_bytes - 1)
            end
            ngx.var.dscache_key = "p-" .. ngx.md5(lead)
            ngx.var.dscache_key_source = "prompt"
            end
            prompt_key()"""
