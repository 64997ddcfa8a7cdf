"""hvd_sparse: gradient sparsification for Horovod (PyTorch and TensorFlow)."""

from setuptools import find_packages, setup

setup(
    name="hvd_sparse",
    version="0.1.0",
    description="Gradient sparsification (ExDyna, DEFT, LAGS-SGD, MiCRO, top-k, ...) for Horovod",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvd_sparse", "hvd_sparse.*"]),
    python_requires=">=3.10",
    install_requires=["numpy"],
    # No framework is pinned here: constraints.txt holds the tested versions.
    extras_require={
        "torch": ["torch", "horovod"],
        "tensorflow": ["tensorflow", "horovod"],
        "mpi": ["mpi4py"],
        "dev": ["pytest", "pytest-timeout", "hypothesis", "ruff", "scikit-learn", "matplotlib"],
    },
    license="Apache-2.0",
)
