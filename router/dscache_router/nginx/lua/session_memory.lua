local live = DSCACHE_LIVE
local sessions = ngx.shared.dscache_sessions
local key = ngx.var.dscache_key
-- A fresh request id names no session: nothing to remember.
local remember = ngx.var.dscache_key_source ~= "new"
local track
-- {picker: a prompt key stands for an opening many conversations share: the pod
-- holding this conversation's own history decides before the opening's memory
if ngx.var.dscache_key_source == "prompt" then
    track = require("dscache_router").locate(key)
end
-- picker}
track = track or (remember and sessions:get(key)) or nil
-- {picker: a session unknown here takes the track of the pod that served it
if remember and not track then
    track = require("dscache_router").locate(key)
end
-- picker}
if not track or not live[track] then
    track = ngx.var.dscache_new_track
end
ngx.var.dscache_chosen_track = track
if remember then
    local ok, err = sessions:set(key, track, DSCACHE_TTL)
    if not ok then
        ngx.log(ngx.WARN, "dscache router: cannot remember a session: ", err)
    end
end
