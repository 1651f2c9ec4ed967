"""The reference workload's ``lookup`` tool as a module for ``greenroom serve --tools``
(``tests.benchmarks.scale_curve`` serves it): async, sleeps 10 ms, parallel-safe."""

from tests.benchmarks.common import greenroom_tool

lookup = greenroom_tool()
