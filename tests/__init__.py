"""The test suite as a package, so its shared helpers import by name (`tests.support.cli`,
...) with the repository root on sys.path (pyproject's pytest `pythonpath`), with no
`sys.path` edits in the tests. The test folders below stay plain directories: pytest's
default import mode imports each test file by its basename, so basenames stay unique
across folders."""
