import gem_kernels


def test_imports():
    assert gem_kernels.__version__
