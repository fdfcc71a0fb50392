#![allow(dead_code, clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use pillar_nvmet::{
    ConfigfsDouble, ExportPlan, ExportSpec, HostAccess, HostNqn, PortId, PortSpec, SubsystemNqn,
    TargetState, VolumeId, apply, observe, plan_export, plan_unexport, volume_export,
};

pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub double: ConfigfsDouble,
    pub device: PathBuf,
}

impl Fixture {
    pub fn new() -> Self {
        Self::build(false)
    }

    /// A fixture whose double models a kernel with NVMe reservations (`resv_enable`).
    pub fn with_reservations() -> Self {
        Self::build(true)
    }

    fn build(reservations: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut double = ConfigfsDouble::create(dir.path().join("nvmet")).unwrap();
        if reservations {
            double = double.with_reservations();
        }
        // The double checks that device_path exists when a namespace is enabled.
        let device = dir.path().join("disk0.img");
        std::fs::write(&device, b"").unwrap();
        Self {
            dir,
            double,
            device,
        }
    }

    pub fn device(&self, name: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, b"").unwrap();
        path
    }

    pub fn state(&self) -> TargetState {
        observe(self.double.root()).unwrap()
    }

    /// Plans and applies `spec` as the agent does (applying up to `replan_after` and planning
    /// again when the plan asks for it), returning the last plan.
    pub fn export(&mut self, spec: &ExportSpec) -> ExportPlan {
        let plan = plan_export(&self.state(), spec).unwrap();
        let Some(at) = plan.replan_after else {
            apply(&mut self.double, &plan.ops).unwrap();
            return plan;
        };
        apply(&mut self.double, &plan.ops[..=at]).unwrap();
        let again = plan_export(&self.state(), spec).unwrap();
        assert_eq!(
            again.replan_after, None,
            "a second plan never needs a third"
        );
        apply(&mut self.double, &again.ops).unwrap();
        again
    }

    /// Plans and applies the removal of `nqn`.
    pub fn unexport(&mut self, nqn: &SubsystemNqn) {
        let ops = plan_unexport(&self.state(), nqn).unwrap();
        apply(&mut self.double, &ops).unwrap();
    }
}

pub fn host(n: u32) -> HostNqn {
    HostNqn::parse(&format!(
        "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-{n:012}"
    ))
    .unwrap()
}

pub fn only(hosts: &[u32]) -> HostAccess {
    HostAccess::Only(hosts.iter().map(|h| host(*h)).collect::<BTreeSet<_>>())
}

pub fn tcp_port(id: u16, svc: u16) -> BTreeMap<PortId, PortSpec> {
    [(
        PortId::new(id),
        PortSpec::tcp(format!("127.0.0.1:{svc}").parse().unwrap()),
    )]
    .into_iter()
    .collect()
}

pub fn export(
    volume: &str,
    device: &std::path::Path,
    access: HostAccess,
    ports: BTreeMap<PortId, PortSpec>,
) -> ExportSpec {
    volume_export(&VolumeId::parse(volume).unwrap(), device, access, ports)
}
