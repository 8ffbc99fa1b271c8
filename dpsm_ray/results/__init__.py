"""Reporting: what is read back from a results directory (``dpsm_ray.storage``) -- the report and
its figures and tables (``report``, ``figures``, ``tables``), the search's provenance, the studies'
and the league's analyses, and their statistics."""
