"""One row per trained model: its quantile diagnostics at the last epoch and, in results that
measured them, the like-for-like quantile errors and each loss term's gradient norm -- what a
study's compact results (``runs.csv``) and a league's (``league-runs.csv``) keep of its epochs.
Pure DataFrame work on the tables passed in: nothing is imported at load (the sweep's front door
reads the study module, which imports this one)."""

from __future__ import annotations

COMPACT_RUNS = ("stage", "seed", "q", "q_dataset_train", "q_error_train", "train_set_size_q", "val_set_size", "q_error_train_all_epochs")
# in results written since they were measured: the like-for-like quantile error (last epoch) and each loss term's
# gradient norm at the first step and at the start of the middle epoch
LIKE_FOR_LIKE = ("q_dataset_train_mode", "q_error_train_mode")
LIKE_FOR_LIKE_D1 = ("q_dataset_train_mode_d1", "q_error_train_mode_d1")  # ... against D1's part alone (results since they were measured)
GRADIENTS = ("ce_grad_norm_first", "size_grad_norm_first", "ce_grad_norm_middle", "size_grad_norm_middle")


def model_rows(evals, epochs, by: str = "stage"):
    """One row per model of ``evals`` -- per (``by``, seed): its arm's or its method's -- from its
    epochs: the quantile diagnostics at the last epoch, ``q_error_train`` averaged over all epochs,
    and, in results that measured them, the like-for-like quantile errors and each loss term's
    gradient norm at the first step and at the start of the middle epoch (``COMPACT_RUNS``'s
    columns, ``by`` first)."""
    if "trial_id" in epochs and "trial_id" in evals:  # a seed that failed and was trained again: the epochs of its model only
        epochs = epochs[epochs.trial_id.isin(set(evals.trial_id))]
    keys = [by, "seed"]
    ordered = epochs.sort_values([*keys, "epoch"])
    runs = ordered.groupby(keys).tail(1).set_index(keys)
    runs = runs.assign(q_error_train_all_epochs=ordered.groupby(keys).q_error_train.mean())
    columns = [by, *COMPACT_RUNS[1:]]
    if set(LIKE_FOR_LIKE) <= set(epochs.columns) and epochs[list(LIKE_FOR_LIKE)].notna().any().any():
        first = ordered.groupby(keys).head(1).set_index(keys)
        middle = ordered[ordered.epoch == (ordered.groupby(keys).epoch.transform("max") + 1) // 2].set_index(keys)
        runs = runs.assign(ce_grad_norm_first=first.ce_grad_norm, size_grad_norm_first=first.size_grad_norm,
                           ce_grad_norm_middle=middle.ce_grad_norm, size_grad_norm_middle=middle.size_grad_norm)
        d1 = [c for c in LIKE_FOR_LIKE_D1 if c in runs.columns]
        return runs.reset_index()[[*columns, *LIKE_FOR_LIKE, *d1, *GRADIENTS]]
    return runs.reset_index()[columns]  # results from before they were measured: the columns they have
