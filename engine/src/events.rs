//! What starts a hydration: an RDS EventBridge event (restore, point-in-time restore, new instance or
//! replica, Multi-AZ conversion, Blue/Green green environment) or a manual input from the console or a
//! pipeline. Parsing is strict: anything malformed or foreign is refused with a field-level message,
//! and an event that is not a trigger is recognised as such (the run then ends cleanly).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Why a run was started. Decides what the workflow may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TriggerKind {
    /// RDS-EVENT-0043 (documented) or RDS-EVENT-0008 (reported): restored from a DB snapshot.
    SnapshotRestore,
    /// RDS-EVENT-0019: restored to a point in time.
    PointInTimeRestore,
    /// RDS-EVENT-0005: instance created (also a new read replica).
    InstanceCreated,
    /// RDS-EVENT-0046: replication resumed / read replica started.
    ReplicaReady,
    /// RDS-EVENT-0025: Single-AZ to Multi-AZ conversion finished. The standby's volume hydrates,
    /// which no session can read: progress polling only.
    MultiAzConversion,
    /// RDS-EVENT-0244 on a Blue/Green deployment: the green environment is ready.
    BlueGreenCreated,
    /// Started by hand or by a pipeline.
    Manual,
}

impl TriggerKind {
    /// Whether sessions may read the instance's blocks (false: poll storage progress only).
    pub fn reads_blocks(self) -> bool {
        self != TriggerKind::MultiAzConversion
    }
}

/// Where the Lambdas get database credentials. Never the password itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Credentials {
    /// The instance's RDS-managed master user secret (DescribeDBInstances MasterUserSecret).
    ManagedSecret,
    /// A Secrets Manager secret with at least `username` and `password`.
    Secret { arn: String },
    /// IAM database authentication as `user` (token signed in the Lambda).
    Iam { user: String },
}

impl Credentials {
    /// The deployment's default: the secret PGHYDRATE_SECRET_ARN names (the stack's SecretArn), or each
    /// instance's RDS-managed master secret when it is empty.
    pub fn deployment_default(secret_arn: Option<String>) -> Credentials {
        match secret_arn.filter(|v| !v.trim().is_empty()) {
            Some(arn) => Credentials::Secret { arn },
            None => Credentials::ManagedSecret,
        }
    }
}

/// Options a manual start may override; the workflow fills the rest from its configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Overrides {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<crate::warm::ModeChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maintenance: Option<crate::maintain::Maintenance>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include_databases: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude_databases: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub first: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<Credentials>,
    /// Skip warming and only wait for storage initialization.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub poll_only: bool,
}

/// A parsed trigger.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trigger {
    pub kind: TriggerKind,
    /// The DB instance, for every kind but Blue/Green.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// The Blue/Green deployment identifier (green instances are resolved from it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deployment: Option<String>,
    /// The event's id (EventBridge `id`), used to recognise a repeated delivery.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    pub overrides: Overrides,
}

/// What a parse can say besides success.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    /// The input is malformed: the run fails with this message (error name `InvalidInput`).
    #[error("invalid input: {0}")]
    Invalid(String),
    /// A well-formed RDS event that is not a hydration trigger: the run ends cleanly.
    #[error("not a hydration trigger: {0}")]
    NotATrigger(String),
}

const MAX_TEXT: usize = 2048;
const MAX_LIST: usize = 100;

fn invalid(msg: impl Into<String>) -> InputError {
    InputError::Invalid(msg.into())
}

fn text<'a>(v: &'a Value, path: &str) -> Result<&'a str, InputError> {
    let mut cur = v;
    for part in path.split('.') {
        cur = cur.get(part).ok_or_else(|| invalid(format!("{path}: missing")))?;
    }
    let s = cur.as_str().ok_or_else(|| invalid(format!("{path}: must be a string")))?;
    if s.is_empty() || s.len() > MAX_TEXT {
        return Err(invalid(format!("{path}: must be 1 to {MAX_TEXT} characters")));
    }
    Ok(s)
}

/// An RDS DB instance identifier: 1-63 letters, digits and hyphens, starting with a letter.
pub fn valid_instance_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.starts_with(|c: char| c.is_ascii_alphabetic())
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        && !s.ends_with('-')
        && !s.contains("--")
}

/// arn:aws[-partition]:rds:REGION:ACCOUNT:RESOURCE_TYPE:NAME
struct RdsArn<'a> {
    region: &'a str,
    account: &'a str,
    resource: &'a str,
    name: &'a str,
}

fn parse_arn(arn: &str) -> Result<RdsArn<'_>, InputError> {
    let parts: Vec<&str> = arn.splitn(7, ':').collect();
    if parts.len() != 7 || parts[0] != "arn" || !parts[1].starts_with("aws") || parts[2] != "rds" {
        return Err(invalid(format!("detail.SourceArn: {arn:?} is not an RDS ARN")));
    }
    let account = parts[4];
    if account.len() != 12 || !account.chars().all(|c| c.is_ascii_digit()) {
        return Err(invalid(format!("detail.SourceArn: account {account:?} is not a 12-digit account id")));
    }
    Ok(RdsArn { region: parts[3], account, resource: parts[5], name: parts[6] })
}

/// Parses the state machine's input: an EventBridge event from `aws.rds`, or a manual input
/// (`{"instance": "...", ...overrides}`). `expect` is the account and region the workflow runs in:
/// an event about another account or region is refused.
pub fn parse_input(
    input: &Value,
    expect_account: Option<&str>,
    expect_region: Option<&str>,
) -> Result<Trigger, InputError> {
    let obj = input.as_object().ok_or_else(|| invalid("input must be a JSON object"))?;
    if obj.contains_key("detail-type") || obj.contains_key("source") {
        parse_event(input, expect_account, expect_region)
    } else {
        parse_manual(input)
    }
}

fn parse_manual(input: &Value) -> Result<Trigger, InputError> {
    let obj = input.as_object().unwrap();
    let instance =
        obj.get("instance").ok_or_else(|| invalid("instance: missing (the DB instance identifier to hydrate)"))?;
    let instance = instance.as_str().ok_or_else(|| invalid("instance: must be a string"))?;
    if !valid_instance_id(instance) {
        return Err(invalid(format!(
            "instance: {:?} is not a DB instance identifier (1-63 letters, digits, hyphens; starts with a letter)",
            truncate(instance)
        )));
    }
    let mut rest = obj.clone();
    rest.remove("instance");
    // Step Functions adds this when a parent execution (a pipeline) starts this one.
    rest.remove("AWS_STEP_FUNCTIONS_STARTED_BY_EXECUTION_ID");
    let overrides: Overrides =
        serde_json::from_value(Value::Object(rest)).map_err(|e| invalid(field_error(&e.to_string())))?;
    validate_overrides(&overrides)?;
    Ok(Trigger {
        kind: TriggerKind::Manual,
        instance: Some(instance.to_string()),
        deployment: None,
        event_id: None,
        region: None,
        account: None,
        overrides,
    })
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

/// serde's messages name the field in backticks; keep them short and field-first.
fn field_error(msg: &str) -> String {
    let short: String = msg.chars().take(300).collect();
    if let Some(rest) = short.strip_prefix("unknown field `") {
        if let Some((field, _)) = rest.split_once('`') {
            return format!("{field}: unknown field (allowed: sessions, mode, maintenance, include_databases, exclude_databases, include, exclude, first, credentials, poll_only)");
        }
    }
    short
}

fn validate_overrides(o: &Overrides) -> Result<(), InputError> {
    if let Some(s) = o.sessions {
        if !(1..=64).contains(&s) {
            return Err(invalid(format!("sessions: {s} is not between 1 and 64")));
        }
    }
    for (name, list) in [
        ("include_databases", &o.include_databases),
        ("exclude_databases", &o.exclude_databases),
        ("include", &o.include),
        ("exclude", &o.exclude),
        ("first", &o.first),
    ] {
        if list.len() > MAX_LIST {
            return Err(invalid(format!("{name}: at most {MAX_LIST} patterns")));
        }
        if let Some(p) = list.iter().find(|p| p.trim().is_empty() || p.len() > 512) {
            return Err(invalid(format!("{name}: pattern {:?} must be 1 to 512 characters", truncate(p))));
        }
        if name != "include_databases" && name != "exclude_databases" {
            for p in list {
                crate::pattern::RelationPattern::parse(p).map_err(|e| invalid(format!("{name}: {e}")))?;
            }
        }
    }
    match &o.credentials {
        Some(Credentials::Secret { arn })
            if !arn.starts_with("arn:aws") || !arn.contains(":secretsmanager:") || arn.len() > MAX_TEXT =>
        {
            return Err(invalid(format!("credentials.arn: {:?} is not a Secrets Manager ARN", truncate(arn))));
        }
        Some(Credentials::Iam { user }) if user.is_empty() || user.len() > 63 => {
            return Err(invalid("credentials.user: must be 1 to 63 characters"));
        }
        _ => {}
    }
    Ok(())
}

fn parse_event(
    input: &Value,
    expect_account: Option<&str>,
    expect_region: Option<&str>,
) -> Result<Trigger, InputError> {
    let source = text(input, "source")?;
    if source != "aws.rds" {
        return Err(invalid(format!("source: {:?} is not aws.rds", truncate(source))));
    }
    let detail_type = text(input, "detail-type")?;
    let event_id = text(input, "id")?.to_string();
    let account = text(input, "account")?;
    let region = text(input, "region")?;
    if let Some(a) = expect_account {
        if a != account {
            return Err(invalid(format!("account: event is about account {account}, this workflow runs in {a}")));
        }
    }
    if let Some(r) = expect_region {
        if r != region {
            return Err(invalid(format!("region: event is about region {region}, this workflow runs in {r}")));
        }
    }
    if !input.get("detail").is_some_and(Value::is_object) {
        return Err(invalid("detail: missing or not an object"));
    }
    let rds_event = text(input, "detail.EventID")?;
    let arn = parse_arn(text(input, "detail.SourceArn")?)?;
    if arn.account != account || arn.region != region {
        return Err(invalid(format!(
            "detail.SourceArn: names account {} region {}, the event came from account {account} region {region}",
            arn.account, arn.region
        )));
    }
    let base = |kind, instance: Option<String>, deployment: Option<String>| Trigger {
        kind,
        instance,
        deployment,
        event_id: Some(event_id.clone()),
        region: Some(region.to_string()),
        account: Some(account.to_string()),
        overrides: Overrides::default(),
    };
    match detail_type {
        "RDS DB Instance Event" => {
            if arn.resource != "db" {
                return Err(invalid(format!("detail.SourceArn: resource type {:?} is not db", truncate(arn.resource))));
            }
            if !valid_instance_id(arn.name) {
                return Err(invalid(format!(
                    "detail.SourceArn: {:?} is not a DB instance identifier",
                    truncate(arn.name)
                )));
            }
            let kind = match rds_event {
                "RDS-EVENT-0043" | "RDS-EVENT-0008" => TriggerKind::SnapshotRestore,
                "RDS-EVENT-0019" => TriggerKind::PointInTimeRestore,
                "RDS-EVENT-0005" => TriggerKind::InstanceCreated,
                "RDS-EVENT-0046" => TriggerKind::ReplicaReady,
                "RDS-EVENT-0025" => TriggerKind::MultiAzConversion,
                other => return Err(InputError::NotATrigger(format!("{} on instance {}", truncate(other), arn.name))),
            };
            Ok(base(kind, Some(arn.name.to_string()), None))
        }
        "RDS Blue Green Deployment Event" => {
            if arn.resource != "deployment" {
                return Err(invalid(format!(
                    "detail.SourceArn: resource type {:?} is not deployment",
                    truncate(arn.resource)
                )));
            }
            let ok = arn.name.len() <= 255 && arn.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
            if !ok || arn.name.is_empty() {
                return Err(invalid(format!(
                    "detail.SourceArn: {:?} is not a Blue/Green deployment identifier",
                    truncate(arn.name)
                )));
            }
            match rds_event {
                "RDS-EVENT-0244" => Ok(base(TriggerKind::BlueGreenCreated, None, Some(arn.name.to_string()))),
                other => Err(InputError::NotATrigger(format!("{} on deployment {}", truncate(other), arn.name))),
            }
        }
        other => Err(InputError::NotATrigger(format!("detail-type {:?}", truncate(other)))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixture(name: &str) -> Value {
        let path = format!("{}/../tests/fixtures/events/{name}.json", env!("CARGO_MANIFEST_DIR"));
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))).unwrap()
    }

    fn parse(v: &Value) -> Result<Trigger, InputError> {
        parse_input(v, Some("123456789012"), Some("us-east-1"))
    }

    #[test]
    fn every_trigger_event_is_recognised() {
        for (name, kind) in [
            ("snapshot-restore-0043", TriggerKind::SnapshotRestore),
            ("snapshot-restore-0008", TriggerKind::SnapshotRestore),
            ("point-in-time-restore-0019", TriggerKind::PointInTimeRestore),
            ("instance-created-0005", TriggerKind::InstanceCreated),
            ("replica-ready-0046", TriggerKind::ReplicaReady),
            ("multi-az-conversion-0025", TriggerKind::MultiAzConversion),
        ] {
            let t = parse(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(t.kind, kind, "{name}");
            assert_eq!(t.instance.as_deref(), Some("orders-restored"), "{name}");
            assert!(t.event_id.is_some());
        }
        let bg = parse(&fixture("blue-green-created-0244")).unwrap();
        assert_eq!(bg.kind, TriggerKind::BlueGreenCreated);
        assert_eq!(bg.deployment.as_deref(), Some("bgd-v53303651eexfake"));
        assert_eq!(bg.instance, None);
        assert!(!TriggerKind::MultiAzConversion.reads_blocks());
    }

    #[test]
    fn other_rds_events_are_not_triggers() {
        assert!(matches!(parse(&fixture("failover-0049")), Err(InputError::NotATrigger(_))));
        let mut switchover = fixture("blue-green-created-0244");
        switchover["detail"]["EventID"] = json!("RDS-EVENT-0248");
        assert!(matches!(parse(&switchover), Err(InputError::NotATrigger(_))));
    }

    /// An edit of an event.
    type Edit = Box<dyn Fn(&mut Value)>;

    #[test]
    fn malformed_and_hostile_events_are_refused_by_field() {
        let cases: Vec<(&str, Edit, &str)> = vec![
            (
                "no detail",
                Box::new(|e| {
                    e.as_object_mut().unwrap().remove("detail");
                }),
                "detail:",
            ),
            ("detail not object", Box::new(|e| e["detail"] = json!("x")), "detail:"),
            (
                "no arn",
                Box::new(|e| {
                    e["detail"].as_object_mut().unwrap().remove("SourceArn");
                }),
                "detail.SourceArn: missing",
            ),
            (
                "arn wrong type",
                Box::new(|e| e["detail"]["SourceArn"] = json!(42)),
                "detail.SourceArn: must be a string",
            ),
            (
                "other account",
                Box::new(|e| e["detail"]["SourceArn"] = json!("arn:aws:rds:us-east-1:999999999999:db:orders-restored")),
                "account 999999999999",
            ),
            (
                "other region in arn",
                Box::new(|e| e["detail"]["SourceArn"] = json!("arn:aws:rds:eu-west-1:123456789012:db:orders-restored")),
                "region eu-west-1",
            ),
            ("event from other account", Box::new(|e| e["account"] = json!("999999999999")), "account:"),
            ("event from other region", Box::new(|e| e["region"] = json!("eu-west-1")), "region:"),
            ("not rds", Box::new(|e| e["source"] = json!("aws.ec2")), "source:"),
            (
                "huge id",
                Box::new(|e| {
                    e["detail"]["SourceArn"] =
                        json!(format!("arn:aws:rds:us-east-1:123456789012:db:{}", "a".repeat(5000)))
                }),
                "characters",
            ),
            (
                "bad instance id",
                Box::new(|e| e["detail"]["SourceArn"] = json!("arn:aws:rds:us-east-1:123456789012:db:x;DROP")),
                "not a DB instance identifier",
            ),
            (
                "cluster arn",
                Box::new(|e| e["detail"]["SourceArn"] = json!("arn:aws:rds:us-east-1:123456789012:cluster:c1")),
                "is not db",
            ),
            ("not an arn", Box::new(|e| e["detail"]["SourceArn"] = json!("orders-restored")), "not an RDS ARN"),
        ];
        for (name, mutate, want) in cases {
            let mut e = fixture("snapshot-restore-0043");
            mutate(&mut e);
            match parse(&e) {
                Err(InputError::Invalid(m)) => assert!(m.contains(want), "{name}: {m}"),
                other => panic!("{name}: {other:?}"),
            }
        }
        assert!(matches!(parse(&json!([1, 2])), Err(InputError::Invalid(_))));
    }

    #[test]
    fn manual_input_with_overrides() {
        let t = parse(&json!({
            "instance": "orders-restored",
            "sessions": 12,
            "mode": "buffer",
            "maintenance": "none",
            "include_databases": ["app*"],
            "first": ["public.orders"],
            "credentials": {"type": "secret", "arn": "arn:aws:secretsmanager:us-east-1:123456789012:secret:db-abc"}
        }))
        .unwrap();
        assert_eq!(t.kind, TriggerKind::Manual);
        assert_eq!(t.overrides.sessions, Some(12));
        assert_eq!(t.overrides.first, vec!["public.orders"]);
        let nested = parse(&json!({"instance": "green-1", "AWS_STEP_FUNCTIONS_STARTED_BY_EXECUTION_ID": "arn:aws:states:us-east-1:123456789012:execution:pipeline:run-7"})).unwrap();
        assert_eq!(nested.instance.as_deref(), Some("green-1"));
        assert!(matches!(t.overrides.credentials, Some(Credentials::Secret { .. })));
    }

    #[test]
    fn malformed_manual_input_names_the_field() {
        for (input, want) in [
            (json!({}), "instance: missing"),
            (json!({"instance": 5}), "instance: must be a string"),
            (json!({"instance": "1bad"}), "instance:"),
            (json!({"instance": "db1", "sesions": 4}), "sesions: unknown field"),
            (json!({"instance": "db1", "sessions": 0}), "sessions: 0"),
            (json!({"instance": "db1", "sessions": 1000}), "sessions: 1000"),
            (json!({"instance": "db1", "sessions": "8"}), "invalid type"),
            (json!({"instance": "db1", "mode": "fast"}), "mode:"),
            (json!({"instance": "db1", "maintenance": "full"}), "maintenance:"),
            (json!({"instance": "db1", "include": [""]}), "include:"),
            (json!({"instance": "db1", "credentials": {"type": "secret", "arn": "nope"}}), "credentials.arn"),
            (json!({"instance": "db1", "credentials": {"type": "password", "value": "x"}}), "unknown variant"),
        ] {
            match parse(&input) {
                Err(InputError::Invalid(m)) => assert!(m.contains(want), "{input}: {m}"),
                other => panic!("{input}: {other:?}"),
            }
        }
    }

    /// Fuzz (bounded, runs in CI): the parsers never panic on any JSON, and what they accept is sound.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn any_json() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(|n| json!(n)),
                any::<f64>().prop_map(|f| json!(f)),
                "\\PC{0,40}".prop_map(Value::String),
                prop::sample::select(vec![
                    "orders-restored",
                    "RDS-EVENT-0043",
                    "aws.rds",
                    "RDS DB Instance Event",
                    "123456789012",
                    "us-east-1",
                    "arn:aws:rds:us-east-1:123456789012:db:orders-restored",
                    "snapshot",
                    "manual",
                    "buffer",
                ])
                .prop_map(|s| json!(s)),
            ];
            leaf.prop_recursive(4, 48, 8, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                    prop::collection::btree_map(
                        prop::sample::select(vec![
                            "instance",
                            "sessions",
                            "mode",
                            "maintenance",
                            "include",
                            "exclude",
                            "first",
                            "credentials",
                            "detail",
                            "source",
                            "detail-type",
                            "account",
                            "region",
                            "resources",
                            "SourceArn",
                            "EventID",
                            "type",
                            "arn",
                            "user",
                            "x",
                        ])
                        .prop_map(str::to_string),
                        inner,
                        0..6,
                    )
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        /// Every path of a JSON value, as pointers ("/detail/SourceArn").
        fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
            out.push(at.clone());
            match v {
                Value::Object(m) => m.iter().for_each(|(k, x)| pointers(x, format!("{at}/{k}"), out)),
                Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| pointers(x, format!("{at}/{i}"), out)),
                _ => {}
            }
        }

        fn check_sound(t: &Trigger) {
            if let Some(i) = &t.instance {
                assert!(valid_instance_id(i), "accepted instance id {i:?}");
            }
            if let Some(s) = t.overrides.sessions {
                assert!((1..=64).contains(&s), "accepted sessions {s}");
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

            #[test]
            fn any_json_is_parsed_or_refused_never_a_panic(v in any_json()) {
                if let Ok(t) = parse(&v) {
                    check_sound(&t);
                }
            }

            #[test]
            fn every_field_of_a_real_event_replaced_by_anything(
                name in prop::sample::select(vec![
                    "snapshot-restore-0043", "point-in-time-restore-0019", "blue-green-created-0244",
                    "multi-az-conversion-0025", "failover-0049",
                ]),
                pick in any::<prop::sample::Index>(),
                replacement in any_json(),
            ) {
                let mut event = fixture(name);
                let mut paths = Vec::new();
                pointers(&event, String::new(), &mut paths);
                let path = pick.get(&paths[1..]).clone();
                *event.pointer_mut(&path).unwrap() = replacement;
                if let Ok(t) = parse(&event) {
                    check_sound(&t);
                    // An accepted event still names this account and region.
                    prop_assert_eq!(t.account.as_deref(), Some("123456789012"));
                    prop_assert_eq!(t.region.as_deref(), Some("us-east-1"));
                }
            }

            #[test]
            fn a_malformed_secret_is_refused_without_echoing_it(text in "\\PC{0,200}", password in "[A-Za-z0-9!#%]{12,30}") {
                for candidate in [text.clone(), format!("{{\"username\": 5, \"password\": \"{password}\"}}"),
                                  format!("{{\"password\": \"{password}\"}}"), format!("{{\"user\": \"{password}\"}}")] {
                    match crate::workflow::credentials_from_secret(&candidate) {
                        Ok((u, p)) => prop_assert!(!u.is_empty() && !p.is_empty()),
                        Err(m) => {
                            prop_assert!(!m.contains(&password), "error echoes the secret: {}", m);
                            if candidate.len() > 3 {
                                prop_assert!(!m.contains(candidate.as_str()), "error echoes the secret: {}", m);
                            }
                        }
                    }
                }
            }
        }
    }
}
