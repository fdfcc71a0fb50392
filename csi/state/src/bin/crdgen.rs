//! Prints pillar's CustomResourceDefinitions as one multi-document YAML stream
//! (`deploy/base/crds.yaml` is this output, checked by a test).

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let yaml = match pillar_state::crd::crds_yaml() {
        Ok(yaml) => yaml,
        Err(e) => {
            eprintln!("crdgen: serialising the CRDs failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = std::io::stdout().lock().write_all(yaml.as_bytes()) {
        eprintln!("crdgen: writing to stdout failed: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
