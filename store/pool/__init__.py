"""The pool's internals, owned by the store: page allocation and eviction policies."""
