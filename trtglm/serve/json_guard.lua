-- The front's guard on Triton's HTTP port (front.py): a request whose JSON nests deeper than MAX_DEPTH levels
-- is refused with a 400 before it reaches tritonserver, whose parser recurses once a level and dies of a deep
-- enough body. Strings are skipped (brackets in text are not nesting); with Triton's binary tensor extension
-- only the JSON header (Inference-Header-Content-Length bytes) is read.
local MAX_DEPTH = __MAX_DEPTH__
local STRUCTURE = '[%[%]{}"]'
local IN_STRING = '["\\]'

local function too_deep(text)
  local depth, i = 0, 1
  while true do
    local at = string.find(text, STRUCTURE, i)
    if at == nil then return false end
    local c = string.byte(text, at)
    if c == 34 then  -- '"': jump past the string's closing quote
      local j = at + 1
      while true do
        local k = string.find(text, IN_STRING, j)
        if k == nil then return false end
        if string.byte(text, k) == 92 then j = k + 2 else i = k + 1; break end  -- '\': skip what it escapes
      end
    elseif c == 91 or c == 123 then  -- '[' or '{'
      depth = depth + 1
      if depth > MAX_DEPTH then return true end
      i = at + 1
    else
      depth = depth - 1
      i = at + 1
    end
  end
end

function envoy_on_request(handle)
  local body = handle:body()
  if body == nil then return end
  local size = body:length()
  local json_size = tonumber(handle:headers():get("inference-header-content-length") or "") or size
  json_size = math.min(json_size, size)
  if json_size > 0 and too_deep(body:getBytes(0, json_size)) then
    handle:respond({[":status"] = "400", ["content-type"] = "application/json"},
                   '{"error":"the request JSON nests deeper than ' .. MAX_DEPTH .. ' levels"}')
  end
end
