"""One adapter per framework, behind `repro.adapters.base.Adapter`, each subclassing its framework's plan.

A plan (`NAME_plan.py`, behind `repro.adapters.plan.FrameworkPlan`) holds what the parent needs before
any process starts and imports neither torch nor the framework; the adapter (`NAME.py`) is what the
ranks run. Framework libraries are imported inside their adapter's methods only, so that `repro --help`
stays fast and a missing framework is reported by name instead of breaking the whole kit.
"""
