import gem_parallel


def test_imports():
    assert gem_parallel.__version__
