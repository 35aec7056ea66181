"""The test suite as a package, so its shared helpers import by name
(`tests.support.cli`, ...) from the repository root (pyproject's pytest `pythonpath`)
and from tools that reuse them, with no `sys.path` edits. Test folders below stay
plain directories (pytest's default import mode imports each test file by its basename,
so basenames stay unique across folders)."""
