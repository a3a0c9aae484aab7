import gem_model


def test_imports():
    assert gem_model.__version__
