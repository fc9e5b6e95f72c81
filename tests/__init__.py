"""The test suite. A package (as are its subfolders) so that equal file names in two folders do not collide; the
helpers every file shares are in ``tests/support``."""
