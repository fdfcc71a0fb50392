//! pillar: CSI controller and node plugin.
