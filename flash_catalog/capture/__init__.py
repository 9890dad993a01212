"""Capture: the calibration call's attention calls, their masks and layouts, and the calibration that meets them."""
