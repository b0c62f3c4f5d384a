"""Lua scripts of the Redis backend: every write and every query is one atomic script call.

Key layout under the prefix ``P`` (bytes, default ``kvtier:index:``):

- ``P c:<key>``    bitmap (SETBIT) of the slots holding chunk ``<key>`` (16 raw bytes); slot =
  location idx * 4 + tier, so a location's tiers are one nibble of one byte.
- ``P e:<slot>``   hash chunk key -> time stored (entries of one location's tier).
- ``P loc:<name>`` hash: idx, status (up|down), last_seen, epoch, seq, reg (JSON).
- ``P locs``       hash name -> idx;  ``P idx`` hash idx -> name;  ``P free`` set of idx;
  ``P next`` counter.
- ``P ns``         hash namespace id (16 raw bytes) -> Namespace JSON ('' = known by id).
- ``P w:<name>``   the writer claim of a location (value = the replica, with a TTL).
- ``P generation`` a random id: missing or changed means Redis lost the rest (see
  ``backend_watch``).

Scripts take the prefix as ARGV[1]. They touch keys they derive from it, so all of them must
live on one node: a single Redis, or on Redis Cluster one shard whose prefix carries a hash
tag (``kvtier:index:{s3}:``, see ``redis_cluster``), which puts every key of it in one slot.
"""

from __future__ import annotations

# Remove `slot` from every key of one tier hash, then delete the hash.
_CLEAR_SLOT = """
local function clear_slot(P, slot)
  local eh = P .. 'e:' .. slot
  local keys = redis.call('HKEYS', eh)
  for _, k in ipairs(keys) do
    local ck = P .. 'c:' .. k
    redis.call('SETBIT', ck, slot, 0)
    if redis.call('BITCOUNT', ck) == 0 then redis.call('DEL', ck) end
  end
  redis.call('DEL', eh)
  return #keys
end
local function clear_loc(P, idx, tier)
  local n = 0
  for t = 0, 2 do
    if tier < 0 or tier == t then n = n + clear_slot(P, idx * 4 + t) end
  end
  return n
end
"""

# KEYS[1] = loc hash. ARGV: P, epoch, seq_from, seq_to, now, then ops as (kind, tier, n, keys...)
# kind: s = stored, r = removed, c = cleared (tier -1 = all tiers).
APPLY = (
    _CLEAR_SLOT
    + """
local P = ARGV[1]
local st = redis.call('HMGET', KEYS[1], 'idx', 'status', 'epoch', 'seq')
if not st[1] then return 'unknown' end
if st[2] ~= 'up' then return 'resync' end
local idx = tonumber(st[1])
local epoch, seq_from, seq_to, now = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
if seq_to > 0 then
  if epoch ~= st[3] or st[3] == '0' then return 'resync' end
  local cur = tonumber(st[4])
  if seq_to <= cur then return 'duplicate' end
  if seq_from > cur + 1 then return 'resync' end
end
local a = 6
while a <= #ARGV do
  local kind, tier, cnt = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  if kind == 'c' then
    clear_loc(P, idx, tier)
  else
    local slot = idx * 4 + tier
    local eh = P .. 'e:' .. slot
    if kind == 's' then
      for j = a, a + cnt - 1 do
        redis.call('SETBIT', P .. 'c:' .. ARGV[j], slot, 1)
        redis.call('HSET', eh, ARGV[j], now)
      end
    else
      for j = a, a + cnt - 1 do
        if redis.call('HDEL', eh, ARGV[j]) == 1 then
          local ck = P .. 'c:' .. ARGV[j]
          redis.call('SETBIT', ck, slot, 0)
          if redis.call('BITCOUNT', ck) == 0 then redis.call('DEL', ck) end
        end
      end
    end
    a = a + cnt
  end
end
if seq_to > 0 then redis.call('HSET', KEYS[1], 'seq', seq_to) end
redis.call('HSET', KEYS[1], 'last_seen', now)
return 'applied'
"""
)

# KEYS[1] = loc hash. ARGV: P, epoch, seq, now. Clears every tier, sets the cursor, UP.
BEGIN_REPLACE = (
    _CLEAR_SLOT
    + """
local P = ARGV[1]
local idx = redis.call('HGET', KEYS[1], 'idx')
if not idx then return 'unknown' end
clear_loc(P, tonumber(idx), -1)
redis.call('HSET', KEYS[1], 'status', 'up', 'epoch', ARGV[2], 'seq', ARGV[3], 'last_seen', ARGV[4])
return 'ok'
"""
)

# KEYS[1] = loc hash. ARGV: P, name, reg_json, now, ns ids...
REGISTER = """
local P = ARGV[1]
for j = 5, #ARGV do
  if redis.call('HEXISTS', P .. 'ns', ARGV[j]) == 0 then return {'unknown_ns', ARGV[j]} end
end
local idx = redis.call('HGET', KEYS[1], 'idx')
if not idx then
  idx = redis.call('SPOP', P .. 'free')
  if not idx then idx = tostring(redis.call('INCR', P .. 'next') - 1) end
  redis.call('HSET', P .. 'locs', ARGV[2], idx)
  redis.call('HSET', P .. 'idx', idx, ARGV[2])
  redis.call('HSET', KEYS[1], 'idx', idx, 'epoch', '0', 'seq', '0')
end
redis.call('HSET', KEYS[1], 'reg', ARGV[3], 'status', 'up', 'last_seen', ARGV[4])
return {'ok', idx}
"""

# KEYS[1] = loc hash. ARGV: P, name, forget (1 = unregister, 0 = drop), only_if_silent_before
# ('' = unconditionally).
DROP = (
    _CLEAR_SLOT
    + """
local P = ARGV[1]
local st = redis.call('HMGET', KEYS[1], 'idx', 'status', 'last_seen')
if not st[1] then return 0 end
if ARGV[4] ~= '' then
  if st[2] ~= 'up' or tonumber(st[3]) >= tonumber(ARGV[4]) then return 0 end
end
clear_loc(P, tonumber(st[1]), -1)
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[1])
  redis.call('HDEL', P .. 'locs', ARGV[2])
  redis.call('HDEL', P .. 'idx', st[1])
  redis.call('SADD', P .. 'free', st[1])
else
  redis.call('HSET', KEYS[1], 'status', 'down', 'epoch', '0', 'seq', '0')
end
return 1
"""
)

# KEYS[1] = loc hash. ARGV: now.
HEARTBEAT = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'unknown' end
redis.call('HSET', KEYS[1], 'last_seen', ARGV[1])
if status ~= 'up' then
  redis.call('HSET', KEYS[1], 'status', 'up')
  return 'resync'
end
return 'ok'
"""

# KEYS[1] = claim key. ARGV: owner, ttl_ms, max_ttl_ms (0 = no bound). Another holder's claim
# that would outlive max_ttl_ms (set by a claimant asking more, by older code, or by hand) is
# cut to it: a claimant that stops renewing loses the source that soon, whatever it asked.
CLAIM = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
local max = tonumber(ARGV[3])
if max > 0 then
  local left = redis.call('PTTL', KEYS[1])
  if left < 0 or left > max then redis.call('PEXPIRE', KEYS[1], max) end
end
return 0
"""

# KEYS[1] = the namespaces hash. ARGV: ns id, definition JSON ('' = known by id only), max
# namespaces (0 = no bound). A definition replaces an id-only entry, never the reverse.
# Returns 0 when the namespace is new and the hash already holds max.
REGISTER_NS = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
  return 1
end
local max = tonumber(ARGV[3])
if max > 0 and redis.call('HLEN', KEYS[1]) >= max then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# ARGV: P, the prompt's chunk keys packed (16 bytes each, in order). The bitmaps are read in
# slices with MGET; a chunk whose bitmap equals the previous one (the usual case: holders
# drop out only where their runs end) costs one string comparison (Lua interns strings).
# Returns {slot, run, ...} and {idx, total, stored_at, name, last_seen, ...}.
QUERY = """
local P, blob = ARGV[1], ARGV[2]
local n = #blob / 16
local band, rshift, byte, floor, sub = bit.band, bit.rshift, string.byte, math.floor, string.sub
local ck = P .. 'c:'
local function key(i) return sub(blob, 16 * i - 15, 16 * i) end
local SLICE = 256
local got, got_from = {}, 1
local function bitmap(i)  -- bitmap of chunk i (1-based), fetching SLICE at a time
  if i >= got_from + #got or i < got_from then
    local names = {}
    local last = i + SLICE - 1
    if i == 1 then last = 8 end  -- most prompts nobody holds: look at the first ones first
    for j = i, math.min(n, last) do names[#names + 1] = ck .. key(j) end
    got, got_from = redis.call('MGET', unpack(names)), i
  end
  local v = got[i - got_from + 1]
  if v == false then return nil end
  return v
end
if n == 0 then return {{}, {}} end
local first = bitmap(1)
if not first then return {{}, {}} end
local slots, locs, seen = {}, {}, {}
for j = 1, #first do
  local b = byte(first, j)
  if b ~= 0 then
    for k = 0, 7 do
      if band(b, rshift(128, k)) ~= 0 then
        local slot = (j - 1) * 8 + k
        slots[#slots + 1] = slot
        local idx = floor(slot / 4)
        if not seen[idx] then
          seen[idx] = true
          locs[#locs + 1] = idx
        end
      end
    end
  end
end
local slot_out, loc_run = {}, {}
local prev = first
local i = 2
while i <= n and #locs > 0 do
  local s = bitmap(i) or ''
  if s ~= prev then
    local len = #s
    local still = {}
    for _, slot in ipairs(slots) do
      local j = floor(slot / 8) + 1
      local b = 0
      if j <= len then b = byte(s, j) end
      if band(b, rshift(128, slot % 8)) ~= 0 then
        still[#still + 1] = slot
      else
        slot_out[#slot_out + 1] = slot
        slot_out[#slot_out + 1] = i - 1
      end
    end
    slots = still
    local lstill = {}
    for _, idx in ipairs(locs) do
      local j = floor(idx / 2) + 1
      local b = 0
      if j <= len then b = byte(s, j) end
      local nib
      if idx % 2 == 0 then nib = rshift(b, 4) else nib = band(b, 15) end
      if nib ~= 0 then lstill[#lstill + 1] = idx else loc_run[idx] = i - 1 end
    end
    locs = lstill
    prev = s
  end
  i = i + 1
end
for _, slot in ipairs(slots) do
  slot_out[#slot_out + 1] = slot
  slot_out[#slot_out + 1] = i - 1
end
for _, idx in ipairs(locs) do loc_run[idx] = i - 1 end
local loc_out = {}
for idx, total in pairs(loc_run) do
  local k = key(total)
  local best = '0'
  for t = 0, 2 do
    local at = redis.call('HGET', P .. 'e:' .. (idx * 4 + t), k)
    if at and tonumber(at) > tonumber(best) then best = at end
  end
  local name = redis.call('HGET', P .. 'idx', tostring(idx))
  local last_seen = '0'
  if name then last_seen = redis.call('HGET', P .. 'loc:' .. name, 'last_seen') or '0' end
  loc_out[#loc_out + 1] = idx
  loc_out[#loc_out + 1] = total
  loc_out[#loc_out + 1] = best
  loc_out[#loc_out + 1] = name or ''
  loc_out[#loc_out + 1] = last_seen
end
return {slot_out, loc_out}
"""
