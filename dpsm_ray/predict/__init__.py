"""The product's second wing: a trained conformal classifier and everything around it.

    predictor.py    ``Predictor``: the model, its calibrated thresholds and its input spec, saved and
                    loaded without Ray (``from dpsm_ray import Predictor``)
    inputs.py       the inputs ``dpsm-ray predict`` reads (arrays, Parquet, image files)
    predictions.py  its output: one row of prediction sets per input
    serving.py      ``dpsm-ray serve``: a predictor behind a small HTTP service
    export.py       finished runs and sweeps as predictors (``dpsm-ray export``)

Nothing is imported here: each module is imported where it is used (``--help`` stays free of torch).
"""
