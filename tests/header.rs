//! include/rdist.h must equal a fresh cbindgen run (RDIST_BLESS=1 rewrites
//! it), carry the crate's version, and contain every name of the contract.

use std::path::Path;

fn generate() -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let config =
        cbindgen::Config::from_file(Path::new(root).join("cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(root)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut out);
    String::from_utf8(out).unwrap()
}

#[test]
fn committed_header_is_fresh() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/rdist.h");
    let fresh = generate();
    if std::env::var_os("RDIST_BLESS").is_some() {
        std::fs::write(&path, &fresh).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "include/rdist.h is stale: run `RDIST_BLESS=1 cargo test --test header` and commit it"
    );
}

#[test]
fn header_version_matches_the_crate() {
    let h = generate();
    for (name, value) in [
        ("RDIST_VERSION_MAJOR", env!("CARGO_PKG_VERSION_MAJOR")),
        ("RDIST_VERSION_MINOR", env!("CARGO_PKG_VERSION_MINOR")),
        ("RDIST_VERSION_PATCH", env!("CARGO_PKG_VERSION_PATCH")),
    ] {
        assert!(
            h.contains(&format!("#define {name} {value}\n")),
            "{name} != {value}"
        );
    }
    let v: Vec<u32> = env!("CARGO_PKG_VERSION")
        .split('.')
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(
        (
            rdist::VERSION_MAJOR,
            rdist::VERSION_MINOR,
            rdist::VERSION_PATCH
        ),
        (v[0], v[1], v[2])
    );
}

#[test]
fn header_has_every_name_of_the_contract() {
    let h = generate();
    let contract = [
        "rdist_version",
        "rdist_result_string",
        "rdist_last_error",
        "rdist_options_create",
        "rdist_options_set",
        "rdist_options_destroy",
        "rdist_init",
        "rdist_get_unique_id",
        "rdist_comm_init_rank",
        "rdist_comm_rank",
        "rdist_comm_size",
        "rdist_comm_local_rank",
        "rdist_comm_backend",
        "rdist_comm_split",
        "rdist_comm_shrink",
        "rdist_comm_abort",
        "rdist_comm_failed_ranks",
        "rdist_comm_destroy",
        "rdist_allreduce",
        "rdist_broadcast",
        "rdist_reduce",
        "rdist_allgather",
        "rdist_reduce_scatter",
        "rdist_gather",
        "rdist_scatter",
        "rdist_alltoall",
        "rdist_barrier",
        "rdist_send",
        "rdist_recv",
        "rdist_group_start",
        "rdist_group_end",
        "rdist_iallreduce",
        "rdist_ibroadcast",
        "rdist_ireduce",
        "rdist_iallgather",
        "rdist_ireduce_scatter",
        "rdist_igather",
        "rdist_iscatter",
        "rdist_ialltoall",
        "rdist_ibarrier",
        "rdist_isend",
        "rdist_irecv",
        "rdist_wait",
        "rdist_test",
        "rdist_request_free",
    ];
    for f in contract {
        assert!(h.contains(&format!("{f}(")), "header lacks {f}");
    }
    for v in [
        "RDIST_SUCCESS = 0",
        "RDIST_ERR_INTERNAL = 11",
        "RDIST_INT8 = 0",
        "RDIST_BFLOAT16 = 9",
        "RDIST_AVG = 4",
        "RDIST_BACKEND_NCCL = 2",
        "RDIST_UNIQUE_ID_BYTES 128",
        "RDIST_SPLIT_NOCOLOR -1",
    ] {
        assert!(h.contains(v), "header lacks {v}");
    }
}
