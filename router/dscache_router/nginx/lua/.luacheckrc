-- luacheck's settings for the router's Lua (scripts/test.sh runs it). The files run in
-- NGINX's Lua module; DSCACHE_* are the values the renderer writes in
-- (dscache_router.nginx.lua).
std = "ngx_lua"
max_line_length = 100
read_globals = {
    "DSCACHE_CONFIG", "DSCACHE_PATH", "DSCACHE_ID", "DSCACHE_INTERVAL",
    "DSCACHE_SCAN", "DSCACHE_MAX_BYTES", "DSCACHE_MAX_MESSAGES",
    "DSCACHE_LIVE", "DSCACHE_TTL",
}
