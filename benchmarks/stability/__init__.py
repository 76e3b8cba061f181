"""A small-scale proxy of large-run training instabilities (Wortsman et al. 2023, arXiv 2309.14322),
with clipopt's tools as treatments, and a data-fault workload.  ``python -m benchmarks.stability``."""
