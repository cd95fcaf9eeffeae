"""Helpers shared by the test folders, imported as ``support.<module>``.

pytest puts ``tests/`` on ``sys.path`` (it holds ``tests/conftest.py``, and the
test folders are not packages), so every test imports this package with no
path set up of its own; the benchmarks put ``tests/`` there themselves.

- ``ap_cases``: the auto-parallel tests' plans, compiled steps and comparisons.
- ``zoo_models``, ``hf_models``, ``plan_models``: the auto-parallel zoo, the
  HuggingFace zoo and the plan fuzzer's models.
- ``titan``: the torchtitan client tests' harness and their tiny Llama3;
  ``pinned``: other projects' packages at the versions the tests pin.
- ``fuzz_*``: the differential program fuzzer (``tests/fuzz``).
- ``library``: the library's source files by module name (``tests/architecture``).
"""
