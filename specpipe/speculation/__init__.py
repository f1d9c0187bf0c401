"""speculation= policies: how much of each draft tree a step verifies (one module per conf/speculation option)."""
