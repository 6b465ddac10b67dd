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
            body = f:read(DSCACHE_SCAN)
            f:close()
        end
    end
end
if not body or body == "" then
    return
end
local max_bytes, max_messages = DSCACHE_MAX_BYTES, DSCACHE_MAX_MESSAGES
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
prompt_key()
