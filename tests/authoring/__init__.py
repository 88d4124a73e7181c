"""Code written as Fiber's docs tell a backend author to write it (see tests/test_authoring.py)."""
