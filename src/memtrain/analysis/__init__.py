"""Analysis: what a training step costs, predicted or measured without a training run.

- :mod:`.estimate`: memory of a step by component, by arithmetic (no torch);
- :mod:`.flops`: FLOPs and bytes of a step, counted, and its roofline;
- :mod:`.trace`: the real step traced under fake tensors (nothing allocated);
- :mod:`.maxbatch`: the largest batch that fits, and one real step's memory;
- :mod:`.plan`: the cheapest technique combination that fits a budget;
- :mod:`.allocator`, :mod:`.device_replay`: the CUDA caching allocator replayed over an
  estimate's first two steps;
- :mod:`.limits`: the size limits every analytic command checks first.

Nothing is imported here, so that importing one of them (``memtrain --help`` imports none)
costs only that one.
"""
