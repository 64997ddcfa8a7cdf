"""Independent NumPy references, one module per thing they re-derive (engine: the gather and
union steps and top-k; deft, threshold, gaussiank, dgc: those methods' selections), written from
docs/algorithms.md rather than from hvd_sparse so that a test compares two implementations.

    from tests.reference.engine import expected_step, topk_indices
"""
