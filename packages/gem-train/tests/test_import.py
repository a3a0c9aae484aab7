import gem_train


def test_imports():
    assert gem_train.__version__
