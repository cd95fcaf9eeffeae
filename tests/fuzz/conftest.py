"""The fuzzer's fixtures, ``fuzz_options`` and ``fuzz_report``, are in ``tests/conftest.py``
(shared with the plan fuzzer, ``tests/auto_parallel/plan_fuzz``)."""
