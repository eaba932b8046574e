"""Tools that run a command as on a machine not at hand: `avx2_only` (an AVX2-only CPU on one with
AVX-512 or AMX) and `half_speed` (a CPU of half this one's speed). Run as
`python3 -m emulate.avx2_only -- COMMAND`; a figure measured under them is an estimate."""
