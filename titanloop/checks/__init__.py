"""The acceptance check of a GPU node (`python -m titanloop.checks`, its --help lists every row): the numerical
checks of the fast path (numerics), the verdicts on what its runs measured (verdicts), and how its trainer runs are
launched and read back (runs, which the GPU benchmarks use too)."""
