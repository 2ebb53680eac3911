"""Every name a run is recorded under in MLflow, defined once: tags, params and metric keys.

Like MLCommons logging's constants module: whoever writes a name (the parent's record, the
follower, `repro settle`, the tracker) and whoever reads it (the matrix, parity, the reports)
imports it from here, so the names cannot drift apart.
"""
from __future__ import annotations

TAG_PREFIX = "repro."

# tags the parent writes when it creates a run (repro.run.record.run_tags)
MODEL = "repro.model"
FRAMEWORK = "repro.framework"
GPUS = "repro.gpus"
NODES = "repro.nodes"
SCALE = "repro.scale"
SEED = "repro.seed"
RECIPE_SHA256 = "repro.recipe_sha256"  # what "is this the same experiment?" is decided on (table2, parity, reports)
DATA_SHA256 = "repro.data_sha256"
DATA_CHECK = "repro.data_check"
GIT_SHA = "repro.git_sha"
RUN_DIR = "repro.run_dir"  # where `repro settle` finds the run's folder
UNVERIFIED_DATA = "repro.unverified_data"
IGNORED_MEMORY_CHECK = "repro.ignored_memory_check"
IMAGE = "repro.image"

# tags of a run's course
RESUMED = "repro.resumed"
RESUMED_FROM_STEP = "repro.resumed_from_step"
EXTENDED = "repro.extended"
SLURM_JOB_ID = "repro.slurm_job_id"  # the latest job of the run
SLURM_JOB_IDS = "repro.slurm_job_ids"  # every job of the run, in order
MEMORY_METHOD = "repro.memory_method"  # how the ranks measured memory (repro.metrics, LBANN's callback)

# tags of a run's end; a resumed run starts without them
ERROR = "repro.error"
INTERRUPTED = "repro.interrupted"
FAILED_RANK = "repro.failed_rank"
SETTLED = "repro.settled"
MODEL_CHECK_LINE = "repro.model_check"  # the run's check of the cost model against its counters, in one line (repro.model.check)
END_TAGS = (ERROR, INTERRUPTED, FAILED_RANK, SETTLED, MODEL_CHECK_LINE)
ERROR_CHARS = 4800  # what of an end's message the ERROR tag keeps (MLflow keeps 5000 characters of a tag)

# tags of the report's own run (repro.report.build)
REPORT = "repro.report"

# param prefixes
EFFECTIVE = "effective."  # what the framework really trains with, the same names for every framework
ADAPTER = "adapter."  # an adapter's setup decisions (a computed pipeline balance, say)

# metric keys
TRAIN_LOSS = "train/loss"
VAL_ACCURACY = "val/accuracy"
VAL_PERPLEXITY = "val/perplexity"
VAL_LOSS = "val/loss"
EPOCH_TIME = "time/epoch_s"
ELAPSED = "time/elapsed_s"
THROUGHPUT = "throughput/samples_per_s"
# {} is median, p10, p90 or mean of the epoch's step times (warm-up left out), or framework_median: the median of
# each step less the loop's own time in it (repro.metrics.framework_median)
STEP_TIME = "time/step_{}_s"
STEP_COUNT = "time/step_count"  # steps the step-time figures summarise
HARNESS_TIME = "time/harness_us"  # the loop's own host time between the frameworks' steps, mean per step
COUNTERS_TIME = "time/counters_us"  # the kit's counters inside the first steps, mean per step of the epoch
PEAK_MEMORY = "memory/peak_bytes"
MODEL_STATE = "memory/model_state_bytes"
ACTIVATION_PEAK = "memory/activation_peak_bytes"  # tensors saved for backward (repro.activation)
ESTIMATED_PEAK = "memory/estimated_peak_bytes"  # model state + activation peak: a GPU's peak, estimated on CPU
FLOP_PHASES = ("forward", "backward", "recompute")  # what repro.flops counts a step's FLOPs under
FLOPS = "flops/{}"  # {} is a FLOP phase or total: one step's counted FLOPs (repro.flops), busiest rank
COMM_BYTES = "comm/bytes_per_step"  # payload a rank hands to its process groups in one step (repro.communication), busiest rank
MODEL_CHECK = "model/{}_{}"  # {quantity}_{bytes|count|error}: the cost model's figure for a run (count: FLOPs), and its relative error (logged at its end)
STEP_TIME_PREDICTED = "model/step_time_predicted"  # the step-time model's seconds a step on this machine's profile
STEP_TIME_ERROR = "model/step_time_error"  # its relative error against the framework's measured median step
COMM_KIND_BYTES = "comm/{}_bytes_per_step"  # {} is an operation kind (all_reduce, send, boundary:activation, ...)
