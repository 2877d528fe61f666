//! Property tests of the create endpoint's parse + validate function
//! (directly, not over HTTP): whatever the body, it never panics, and it
//! yields either a valid VM or a 4xx error naming a field.

use std::collections::BTreeMap;

use keel::api::vms::parse_create;
use proptest::prelude::*;
use serde_json::{Map, Value};

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0u64..=300).prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1e20f64..1e20).prop_map(Value::from),
        Just(Value::from(u64::MAX)),
        Just(Value::from(-1)),
    ]
}

fn name() -> impl Strategy<Value = Value> {
    prop_oneof![
        "[a-z0-9][-a-z0-9]{0,8}[a-z0-9]".prop_map(Value::from),
        "[a-z0-9]{63,65}".prop_map(Value::from),
        Just(Value::from("..")),
        Just(Value::from("a/b")),
        Just(Value::from("a\u{0}b")),
        Just(Value::from("")),
        ".{0,12}".prop_map(Value::from),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        number(),
        name(),
        Just(Value::from("/boot/vmlinuz")),
        Just(Value::from("Manual")),
        Just(Value::from("Stopped")),
    ]
}

fn any_json() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,12}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Mostly the right keys, with values that are sometimes right.
fn object_with(keys: &'static [&'static str], value: BoxedStrategy<Value>) -> BoxedStrategy<Value> {
    prop::collection::btree_map(
        prop_oneof![
            9 => prop::sample::select(keys).prop_map(String::from),
            1 => "[a-z_]{1,8}",
        ],
        value,
        0..keys.len() + 2,
    )
    .prop_map(|m: BTreeMap<String, Value>| Value::Object(m.into_iter().collect::<Map<_, _>>()))
    .boxed()
}

fn spec_value() -> BoxedStrategy<Value> {
    let disk = object_with(&["name", "size_mib"], prop_oneof![name(), number()].boxed());
    let boot = object_with(
        &["kernel", "initrd", "cmdline"],
        prop_oneof![leaf(), Just(Value::from("/k,x"))].boxed(),
    );
    let field = prop_oneof![
        3 => number(),
        1 => prop::collection::vec(disk, 0..3).prop_map(Value::Array),
        1 => boot,
        1 => prop::sample::select(vec!["AlwaysOn", "AlwaysOff", "Manual", "AlwaysOnUnlessStoppedManually", "Running", "Stopped", "bogus"]).prop_map(Value::from),
        1 => leaf(),
    ];
    object_with(
        &[
            "cpus",
            "memory_mib",
            "disks",
            "boot",
            "run_policy",
            "power",
            "restart_generation",
            "stop_grace_period_s",
            "node",
        ],
        field.boxed(),
    )
}

/// A valid spec with a few fields overridden by sometimes-wrong values.
fn mutated_spec() -> impl Strategy<Value = Value> {
    let override_value = prop_oneof![
        ("cpus", prop_oneof![3 => (1u64..=4).prop_map(Value::from), 1 => number(), 1 => leaf()]),
        ("memory_mib", prop_oneof![3 => (16u64..=4096).prop_map(Value::from), 1 => number(), 1 => leaf()]),
        ("disks", prop_oneof![
            3 => prop::collection::vec(
                (name(), prop_oneof![3 => (1u64..=1024).prop_map(Value::from), 1 => number()])
                    .prop_map(|(n, s)| serde_json::json!({"name": n, "size_mib": s})),
                0..3,
            ).prop_map(Value::Array),
            1 => prop::collection::vec(any_json(), 0..2).prop_map(Value::Array),
            1 => leaf(),
        ]),
        ("boot", prop_oneof![
            object_with(&["kernel", "initrd", "cmdline"], prop_oneof![
                3 => prop::sample::select(vec!["/boot/vmlinuz", "/k,x", "rel/path", "/a/../b", "console=ttyS0"]).prop_map(Value::from),
                1 => leaf(),
            ].boxed()),
            leaf(),
        ]),
        ("run_policy", prop::sample::select(vec!["AlwaysOn", "AlwaysOff", "Manual", "AlwaysOnUnlessStoppedManually", "manual", "bogus"]).prop_map(Value::from)),
        ("power", prop_oneof![prop::sample::select(vec!["Running", "Stopped", "Off"]).prop_map(Value::from), leaf()]),
        ("restart_generation", number()),
        ("stop_grace_period_s", prop_oneof![3 => (1u64..=3600).prop_map(Value::from), 1 => number()]),
        ("node", name()),
        ("bogus", leaf()),
    ];
    (
        prop::collection::vec(override_value, 0..3),
        prop::collection::vec(prop::sample::select(vec!["cpus", "memory_mib"]), 0..2),
    )
        .prop_map(|(overrides, removed)| {
            let mut spec = serde_json::json!({"cpus": 1, "memory_mib": 64});
            let obj = spec.as_object_mut().unwrap();
            for key in removed {
                obj.remove(key);
            }
            for (key, value) in overrides {
                obj.insert(key.to_string(), value);
            }
            spec
        })
}

fn body() -> impl Strategy<Value = Value> {
    (
        prop::option::weighted(0.95, name()),
        prop::option::weighted(
            0.95,
            prop_oneof![6 => mutated_spec().boxed(), 1 => spec_value(), 1 => any_json().boxed()],
        ),
        prop::option::weighted(0.05, ("[a-z_]{0,8}", any_json())),
    )
        .prop_map(|(name, spec, extra)| {
            let mut m = Map::new();
            if let Some(n) = name {
                m.insert("name".into(), n);
            }
            if let Some(s) = spec {
                m.insert("spec".into(), s);
            }
            if let Some((k, v)) = extra {
                m.insert(k, v);
            }
            Value::Object(m)
        })
}

fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
    match parse_create(bytes) {
        Ok(vm) => {
            prop_assert!(vm.validate().is_ok(), "accepted an invalid VM: {vm:?}");
            prop_assert_eq!(vm.generation, 1);
            prop_assert!(vm.deletion_requested_at.is_none());
        }
        Err(err) => {
            prop_assert!(
                err.status().is_client_error(),
                "status {} for {:?}",
                err.status(),
                String::from_utf8_lossy(bytes)
            );
            prop_assert!(!err.message().is_empty());
            prop_assert!(
                err.field().is_some_and(|f| !f.is_empty()),
                "no field named for {:?}: {err}",
                String::from_utf8_lossy(bytes)
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn json_bodies_give_a_valid_vm_or_a_field_error(body in body()) {
        check(body.to_string().as_bytes())?;
    }

    #[test]
    fn arbitrary_json_gives_a_valid_vm_or_a_field_error(body in any_json()) {
        check(body.to_string().as_bytes())?;
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        check(&bytes)?;
    }

    #[test]
    fn truncated_or_spliced_json_never_panics(body in body(), cut in any::<prop::sample::Index>(), junk in ".{0,8}") {
        let text = body.to_string();
        let at = cut.index(text.len() + 1);
        let mut mangled = text.as_bytes()[..at].to_vec();
        mangled.extend_from_slice(junk.as_bytes());
        mangled.extend_from_slice(&text.as_bytes()[at..]);
        check(&mangled)?;
    }
}

#[test]
fn a_well_formed_body_is_accepted() {
    let vm = parse_create(
        br#"{"name":"web-1","spec":{"cpus":2,"memory_mib":512,"disks":[{"name":"root","size_mib":1024}],"run_policy":"Manual","power":"Stopped"}}"#,
    )
    .unwrap();
    assert_eq!(vm.name, "web-1");
    assert_eq!(vm.spec.disks.len(), 1);
}

/// Guards against a vacuous property: the generator must reach both
/// accepted VMs and each kind of refusal.
#[test]
fn generator_reaches_accepts_and_both_kinds_of_refusal() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = body();
    let (mut ok, mut bad_request, mut invalid) = (0, 0, 0);
    for _ in 0..2000 {
        let body = strategy.new_tree(&mut runner).unwrap().current();
        match parse_create(body.to_string().as_bytes()) {
            Ok(_) => ok += 1,
            Err(e) if e.status().as_u16() == 400 => bad_request += 1,
            Err(e) if e.status().as_u16() == 422 => invalid += 1,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(
        ok >= 20 && bad_request >= 20 && invalid >= 20,
        "ok {ok}, 400 {bad_request}, 422 {invalid}"
    );
}
