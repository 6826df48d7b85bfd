"""``python -m mindqwen.doctor KIND OUT DEVICE``: one worker of the doctor's parallel check (what
``mindqwen doctor`` launches, under msrun or alone); users run ``mindqwen doctor``."""
import sys

from mindqwen.doctor import parallel_worker

parallel_worker(*sys.argv[1:4])
