if ngx.worker.id() ~= 0 then
    return
end
local ffi = require "ffi"
pcall(ffi.cdef, "int kill(int pid, int sig); int getppid(void);")
local path, loaded, signalled = DSCACHE_PATH, DSCACHE_ID, nil
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
local ok, err = ngx.timer.every(DSCACHE_INTERVAL, check)
if not ok then
    ngx.log(ngx.ERR, "dscache router: cannot watch ", path, ": ", err)
end
