"""jlco: DeepSeek-V3.2 (MLA + DeepSeek Sparse Attention) decode with the MLA latent cache
in host memory. See README.md and ../shared/design/ARCHITECTURE.md."""

__version__ = "0.1.0"
