"""Federated partitions: which train/test samples each client holds.

    file.py         Partition: the per-client index arrays, the spec and seed, and their .npz file (what runs read)
    class_order.py  which class name each class prompt gets (what the CLIP runs read besides the file)
    spec.py         a spec checked and normalised, its id, what it asks of a dataset (config validation)
    make.py         make_partition (the scheme's draw, then the keys every scheme takes) and class counts
    registry.py     schemes registered by name (``@register_scheme``), found in schemes/
    draw.py         what the schemes share: pools, integer shares, cuts, the test-side rules, keep_fraction
    schemes/        label_skew.py (iid, dirichlet, classes_per_client: SGPT, pathological and dirichlet_per_client:
                    FedPFT), domain.py, fedhpl.py (dirichlet_overlap, class_subsets), fedotp.py (fewshot_pathological,
                    pachinko, coarse_split)
    plots.py        per-client class-count heatmaps

Nothing is imported here, so a run that reads a partition file imports file.py alone, not the schemes.
"""
