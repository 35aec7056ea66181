"""Small helpers shared by the entry points and tools: `atomic` (write a file or a whole
directory so that readers see the old state or the new one, never half of it, and check
that an output path is writable before long work starts), `cli` (one-line error exits
without a traceback, and a tool's JSON + table ending), `compile_cache` (JAX's persistent
compilation cache, on by default for every entry point that compiles) and `buckets` (the
power-of-two rule that turns lengths into static shapes).

May import only the Python standard library, so that every wing (and a CLI before it
loads jax) can use it; `compile_cache` configures jax through `sys.modules` when jax is
already loaded and through its environment variables otherwise.
"""
