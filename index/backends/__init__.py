"""Where the index keeps what it knows: ``memory.MemoryIndex`` (in-process; the reference
semantics) and ``redis.RedisIndex`` (shared by index replicas, outlives a restart; its Lua
scripts in ``redis_lua``, its lost-data detection in ``redis_watch``).

May import: ``kvtier.index.api``, ``kvtier.index.rules``, ``kvtier.core``.
"""
