"""What a run tells its operator: the notes log, the plots, the published head and its report."""
