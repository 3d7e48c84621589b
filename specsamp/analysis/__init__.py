"""What is done with completions after decoding: reading the output tables (`outputs`), the
DuckDB report and its figures (`report`, `plots`), pass@1 / ROUGE (`evaluation`, run in the
`sandbox` with its `sandbox_seccomp` filter and `sandbox_driver`, plus the `differential`
check), the benchmarks (`bench`, `throughput`), the exactness audit (`audit`) and the
greedy agreement of two weight formats (`weights_agreement`).
"""
