"""Compile-time analysis of the step and the kernels: HLO traffic, memory plans, trace attribution,
deviceless GPU compilation and register counts. Run each as a module: python -m tools.NAME."""
