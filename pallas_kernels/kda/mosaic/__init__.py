"""The Mosaic GPU (wgmma, TMA) lowering of KDA's inter-chunk state passes: ports of scan.py that the op
runs where they apply (config.Config.scan_lowering)."""
