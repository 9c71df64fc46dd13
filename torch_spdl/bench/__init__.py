"""``python -m torch_spdl.bench``: torch's DataLoader against torch_spdl's (being built).

:mod:`.server` and :mod:`.http` are the loopback HTTP item store, its client and dataset.
"""
