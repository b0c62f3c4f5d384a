"""The store's local disk tier: cold chunks copied to files before eviction takes them
(``backend.DiskBackend``), the files' format (``files``) and the table of what is on disk
(``catalog``). docs/disk.md says how it behaves and what it costs."""
