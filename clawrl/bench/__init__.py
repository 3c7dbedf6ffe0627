"""Benchmarks (`clawrl bench NAME`) and the stand-in engine they and the tests run
(fake_engine.py). Outside the product: may import any room but cli/; nothing in the
product imports it."""
