import gem_precision


def test_imports():
    assert gem_precision.__version__
