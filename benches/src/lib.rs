//! pillar: Benchmarks.
