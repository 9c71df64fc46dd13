"""``python -m torch_spdl.bench``: torch's DataLoader against torch_spdl's on three workloads.

One module per concept: :mod:`.data` (the synthetic ImageFolder and its cache), :mod:`.memory`
(PSS of a process tree), :mod:`.measure` (interleaved rounds, medians), one module per workload
(:mod:`.images` A, :mod:`.remote` B with :mod:`.http` and :mod:`.server`, :mod:`.strings` C),
:mod:`.targets` (the issue's targets as ratios) and :mod:`.report` (table, JSON, plot).
"""
