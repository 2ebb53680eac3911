"""Reports of the Table 2 matrix, built from the runs MLflow holds: tables, figures, findings."""
