"""``kvtier trace``: read, analyse, sample, simulate and replay KV-cache workload traces.

See docs/traces.md. Everything here streams: a trace is read one request at a time.
"""
