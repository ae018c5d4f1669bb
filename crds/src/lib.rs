//! `GlmFlashDeployment` (`glmflash.io/v1alpha1`, short name `gfd`): GLM-5.3-Flash servers,
//! one per GPU node (`replicas` of them behind one Service), each with its packed expert
//! store on that node's NVMe; `hibernate` stops them and releases the GPUs but keeps the
//! stores and routing histories for a fast wake.
//!
//! The spec is what a user of the seed's `docker run` would have typed: model source, mode,
//! the cgroup memory cap the RAM tier is sized from, VRAM expert slots, the store's host
//! path, the OpenAI server's settings, metrics and image. Every field has the seed's
//! default, so the smallest valid object names only the model and the memory cap.
//!
//! Validation lives in two places that must agree:
//! - CEL rules (`x-kubernetes-validations`) in the generated CRD, so the API server rejects
//!   cross-field mistakes at `kubectl apply` time;
//! - [`GlmFlashDeployment::validate`], which the operator runs before doing anything: it
//!   evaluates the very same CEL rules client-side (kube's `cel` feature) plus the checks
//!   CEL cannot express, so an object admitted by an older CRD still ends in a clear
//!   condition instead of a crash loop.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Node label set by NVIDIA's GPU feature discovery naming the GPU model.
pub const GPU_PRODUCT_LABEL: &str = "nvidia.com/gpu.product";
/// The value GPU feature discovery writes for the card this project targets.
pub const RTX_3090_PRODUCT: &str = "NVIDIA-GeForce-RTX-3090";
/// Extended resource name of an NVIDIA GPU.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Routed experts in GLM-5.3-Flash: 42 MoE layers x 288 experts.
pub const TOTAL_EXPERTS: u32 = 42 * 288;
/// Annotation that hibernates an object like `spec.hibernate: true` (value `"true"`), for
/// `kubectl annotate` and for the activator, which must not own the spec.
pub const HIBERNATE_ANNOTATION: &str = "glmflash.io/hibernate";
/// Where the generated CRD is checked in, relative to the workspace root.
pub const CRD_FILE: &str = "crds/glmflash.io_glmflashdeployments.yaml";
/// The chart's copy of the CRD (Helm installs `crds/` before templates).
pub const CHART_CRD_FILE: &str = "charts/glmflash/crds/glmflash.io_glmflashdeployments.yaml";

/// Desired state of one GLM-5.3-Flash server.
// Several `printcolumn(type_ = "string")` look like one attribute repeated to clippy.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[kube(
    group = "glmflash.io",
    version = "v1alpha1",
    kind = "GlmFlashDeployment",
    namespaced,
    shortname = "gfd",
    category = "glmflash",
    status = "GlmFlashDeploymentStatus",
    doc = "GlmFlashDeployment serves GLM-5.3-Flash from one GPU node with tiered experts",
    derive = "PartialEq",
    cel,
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.ready"),
    printcolumn(name = "Node", type_ = "string", json_path = ".status.node"),
    printcolumn(name = "Mode", type_ = "string", json_path = ".spec.mode"),
    printcolumn(
        name = "VRAM experts",
        type_ = "integer",
        json_path = ".status.live.plan.vramExpertSlots"
    ),
    printcolumn(
        name = "Tok/s",
        type_ = "number",
        json_path = ".status.live.decodeTokensPerSecond"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(
    validation = Rule::new("self.server.prefillChunk <= self.server.contextLength")
        .message("server.prefillChunk must not exceed server.contextLength"),
    validation = Rule::new(
        "self.mode.startsWith('nvme') || !isQuantity(self.memory.limit) || quantity(self.memory.limit).compareTo(quantity('128Gi')) >= 0"
    )
    .message("modes fast and exact hold all 12,096 experts (117 GB) in RAM: memory.limit must be at least 128Gi; use mode nvme for smaller caps"),
    validation = Rule::new("self.replicas == 1 || !has(self.placement.nodeName)")
        .message("placement.nodeName pins one node and every replica needs its own: set replicas to 1 or use placement.nodeSelector"),
)]
#[serde(rename_all = "camelCase")]
pub struct GlmFlashDeploymentSpec {
    /// Where the weights come from.
    pub model: ModelSource,
    /// Servers, each on its own node with its own store, behind one Service.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 1, max = 64))]
    pub replicas: i32,
    /// Stop every server and release their GPUs, keeping the stores and routing histories
    /// on the nodes; `false` wakes them (the annotation `glmflash.io/hibernate: "true"`
    /// does the same without touching the spec).
    #[serde(default)]
    pub hibernate: bool,
    /// Hibernate after this long without completion requests (`90s`, `30m`, `1h30m`; at
    /// least `1m`; absent: never). The operator reads each server's request counters when
    /// it looks at a running deployment (about once a minute) and, once no replica has
    /// served or held a completion request for this long, sets the `glmflash.io/hibernate`
    /// annotation; the activator (the chart's `activator.enabled`) removes it again on the
    /// next request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^([0-9]+h)?([0-9]+m)?([0-9]+s)?$') && self != '' && duration(self) >= duration('1m')").message("idleAfter must be a duration such as 90s, 30m or 1h30m, of at least 1m"))]
    #[schemars(length(max = 32))]
    pub idle_after: Option<String>,
    /// Serving mode: fast and exact keep every expert in RAM; nvme and nvme-exact tier
    /// experts across VRAM, pinned RAM and the NVMe store.
    #[serde(default)]
    pub mode: Mode,
    /// Which node may run the server.
    #[serde(default)]
    pub placement: Placement,
    /// The server's cgroup memory; the pinned RAM tier is sized from it.
    pub memory: MemorySpec,
    /// GPU memory settings.
    #[serde(default)]
    pub vram: VramSpec,
    /// The packed expert store on the node's NVMe.
    #[serde(default)]
    pub store: StoreSpec,
    /// The OpenAI-compatible server.
    #[serde(default)]
    pub server: ServerSpec,
    /// Prometheus and Grafana integration.
    #[serde(default)]
    pub metrics: MetricsSpec,
    /// The glmflash-node image, used by the pack-store Job and the server.
    #[serde(default)]
    pub image: ImageSpec,
}

/// Model weights: a Hugging Face repository at a pinned revision, or a directory that
/// already exists on the node. Exactly one of the two.
#[derive(KubeSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("has(self.huggingFace) != has(self.nodePath)")
        .message("model: set exactly one of huggingFace or nodePath"),
)]
#[serde(rename_all = "camelCase")]
pub struct ModelSource {
    /// Download from the Hugging Face Hub (by glmflash-node's own Hub client).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<HuggingFaceSource>,
    /// Absolute path of a checkpoint directory on the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.startsWith('/') && self != '/'").message("model.nodePath must be an absolute path below /"))]
    #[schemars(length(max = 4096))]
    pub node_path: Option<String>,
    /// Weight format of the routed experts in the packed store: the pack-store Job quantizes
    /// a bf16 checkpoint's experts to it (`q4_k`: 4.5 bits per weight, about 172 GB of store
    /// for the real model), keeps an EXL3 checkpoint's experts as they are (`exl3`: about
    /// 114.6 GB at 3 bits per weight), or keeps them as the checkpoint stores them
    /// (`checkpoint`).
    #[serde(default)]
    pub expert_format: ExpertFormat,
}

/// A Hugging Face model repository pinned to a revision.
#[derive(KubeSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HuggingFaceSource {
    /// Repository id, `owner/name`.
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$')").message("model.huggingFace.repo must look like owner/name"))]
    #[schemars(length(max = 256))]
    pub repo: String,
    /// Branch, tag or commit. Pin a commit: the store is rebuilt when this changes.
    #[schemars(length(min = 1, max = 128))]
    pub revision: String,
    /// Secret key holding a Hub token, for gated repositories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret: Option<SecretKeyRef>,
}

/// A key in a Secret in the object's namespace.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Secret name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key inside the Secret.
    #[serde(default = "default_secret_key")]
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

fn default_replicas() -> i32 {
    1
}

fn default_secret_key() -> String {
    "token".into()
}

/// Expert weight formats of the packed store (glmflash-node `pack-store --format`).
#[derive(JsonSchema, Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ExpertFormat {
    /// 4-bit blocks of 256 with 6-bit scales and mins (GGML Q4_K): 4.5 bits per weight.
    #[default]
    #[serde(rename = "q4_k")]
    Q4K,
    /// 8-bit blocks of 32 (GGML Q8_0): 8.5 bits per weight.
    #[serde(rename = "q8_0")]
    Q8_0,
    /// bfloat16.
    #[serde(rename = "bf16")]
    Bf16,
    /// An EXL3 (exllamav3) checkpoint's trellises as they are; needs an EXL3 checkpoint.
    #[serde(rename = "exl3")]
    Exl3,
    /// As the checkpoint stores them (a checkpoint converted with `convert-experts`).
    #[serde(rename = "checkpoint")]
    Checkpoint,
}

impl ExpertFormat {
    /// The `pack-store --format` value; `None` keeps the checkpoint's format.
    pub fn as_arg(self) -> Option<&'static str> {
        match self {
            ExpertFormat::Q4K => Some("q4_k"),
            ExpertFormat::Q8_0 => Some("q8_0"),
            ExpertFormat::Bf16 => Some("bf16"),
            ExpertFormat::Exl3 => Some("exl3"),
            ExpertFormat::Checkpoint => None,
        }
    }
}

/// Serving mode, as in the seed's `GLM53_MODE`.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// All experts in RAM, CPU lane on.
    Fast,
    /// All experts in RAM, every product by the same kernel.
    Exact,
    /// Experts tiered across VRAM, pinned RAM and NVMe, CPU lane on.
    #[default]
    Nvme,
    /// Tiered, bit-identical to the untiered exact run.
    NvmeExact,
}

impl Mode {
    /// The value glmflash-node's `--mode` flag takes.
    pub fn as_arg(self) -> &'static str {
        match self {
            Mode::Fast => "fast",
            Mode::Exact => "exact",
            Mode::Nvme => "nvme",
            Mode::NvmeExact => "nvme-exact",
        }
    }
}

/// Node placement. The operator picks one node that matches all of it and has a free GPU
/// and enough allocatable memory for `memory.limit`, and pins the Job and server there.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// Run on exactly this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// Labels the node must carry.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations for the node's taints, copied into the Job and server pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Required value of the `nvidia.com/gpu.product` node label; empty accepts any GPU.
    #[serde(default = "default_gpu_product")]
    pub gpu_product: String,
    /// Request one `nvidia.com/gpu` for the server. Off only for tests on clusters without
    /// GPUs (the e2e suite's CPU switch): the server cannot serve without one.
    #[serde(default = "default_require_gpu")]
    pub require_gpu: bool,
}

fn default_require_gpu() -> bool {
    true
}

fn default_gpu_product() -> String {
    RTX_3090_PRODUCT.into()
}

impl Default for Placement {
    fn default() -> Self {
        Self {
            node_name: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            gpu_product: default_gpu_product(),
            require_gpu: default_require_gpu(),
        }
    }
}

/// Memory of the server pod.
#[derive(KubeSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[x_kube(
    // Only once each field is valid on its own, so a bad value gets its own message first.
    validation = Rule::new("!isQuantity(self.limit) || !isQuantity(self.shmSize) || quantity(self.limit).compareTo(quantity('16Gi')) < 0 || quantity(self.shmSize).compareTo(quantity('1Mi')) < 0 || quantity(self.shmSize).isLessThan(quantity(self.limit))")
        .message("memory.shmSize must be smaller than memory.limit"),
)]
#[serde(rename_all = "camelCase")]
pub struct MemorySpec {
    /// `limits.memory` of the server container (the cgroup cap), e.g. `55Gi` or `16Gi`.
    #[x_kube(validation = Rule::new("isQuantity(self) && quantity(self).compareTo(quantity('16Gi')) >= 0").message("memory.limit must be a quantity of at least 16Gi"))]
    #[schemars(length(max = 32))]
    pub limit: String,
    /// Size of the memory-backed `/dev/shm`: at least 1Mi, less than `limit`.
    #[serde(default = "default_shm_size")]
    #[x_kube(validation = Rule::new("isQuantity(self) && quantity(self).compareTo(quantity('1Mi')) >= 0").message("memory.shmSize must be a quantity of at least 1Mi, such as 1Gi"))]
    #[schemars(length(max = 32))]
    pub shm_size: String,
}

fn default_shm_size() -> String {
    "1Gi".into()
}

/// GPU memory.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VramSpec {
    /// VRAM expert slots; absent sizes the tier from free VRAM after the other weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 12096))]
    pub expert_slots: Option<u32>,
    /// The server refuses to start with less free VRAM than this (MiB).
    #[serde(default = "default_min_free_vram_mib")]
    #[schemars(range(min = 1))]
    pub min_free_mib: u32,
}

fn default_min_free_vram_mib() -> u32 {
    23_000
}

impl Default for VramSpec {
    fn default() -> Self {
        Self {
            expert_slots: None,
            min_free_mib: default_min_free_vram_mib(),
        }
    }
}

/// The packed expert store on the node.
#[derive(KubeSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StoreSpec {
    /// Host directory on a local NVMe filesystem that supports O_DIRECT (xfs, ext4).
    /// The store goes to `<hostPath>/store`, Hub downloads to `<hostPath>/hf`.
    #[serde(default = "default_store_host_path")]
    #[x_kube(validation = Rule::new("self.startsWith('/') && self != '/'").message("store.hostPath must be an absolute path below /"))]
    #[schemars(length(max = 4096))]
    pub host_path: String,
    /// What happens to the store when the object is deleted.
    #[serde(default)]
    pub reclaim_policy: ReclaimPolicy,
    /// Pod retries of a failed pack-store Job before it is reported failed.
    #[serde(default = "default_pack_retries")]
    #[schemars(range(min = 0, max = 10))]
    pub pack_retries: i32,
}

fn default_store_host_path() -> String {
    "/mnt/nvme/glmflash".into()
}

fn default_pack_retries() -> i32 {
    2
}

impl Default for StoreSpec {
    fn default() -> Self {
        Self {
            host_path: default_store_host_path(),
            reclaim_policy: ReclaimPolicy::default(),
            pack_retries: default_pack_retries(),
        }
    }
}

/// Store reclaim policy.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ReclaimPolicy {
    /// Keep the store (it took hours to build).
    #[default]
    Retain,
    /// Delete the store directory with a cleanup Job on the node.
    Delete,
}

/// The OpenAI-compatible server.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServerSpec {
    /// Container and Service port of the OpenAI API.
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// Model id the API reports and accepts.
    #[serde(default = "default_served_model_name")]
    #[schemars(length(min = 1, max = 128))]
    pub served_model_name: String,
    /// KV cache length in tokens.
    #[serde(default = "default_context_length")]
    #[schemars(range(min = 256, max = 1_048_576))]
    pub context_length: u32,
    /// Sequences decoded together.
    #[serde(default = "default_max_batch_size")]
    #[schemars(range(min = 1, max = 256))]
    pub max_batch_size: u32,
    /// Prefill chunk in tokens.
    #[serde(default = "default_prefill_chunk")]
    #[schemars(range(min = 16, max = 1_048_576))]
    pub prefill_chunk: u32,
    /// How the server caches its sequences' MLA latents and DSA indexer keys
    /// (`--cache-dtype`): `f32`, or `bf16` / `f16` at half the bytes, which leaves VRAM for
    /// more expert slots and moves the logits slightly (the node's BENCHMARKS.md).
    #[serde(default)]
    pub cache_dtype: CacheDtype,
    /// Secret key holding the API key clients must send as a bearer token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret: Option<SecretKeyRef>,
    /// How the Service spreads requests over the replicas. Each replica's VRAM and RAM
    /// tiers and KV cache are warm for what it served, so a conversation does best on one
    /// replica: `ClientIP` keeps each client on one (Kubernetes can pin by client address
    /// only; behind a proxy every request comes from the proxy's address).
    #[serde(default)]
    pub session_affinity: SessionAffinity,
}

/// How a server stores its sequence caches' values.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum CacheDtype {
    #[default]
    F32,
    Bf16,
    F16,
}

impl CacheDtype {
    /// The value of `glmflash-node serve --cache-dtype`.
    pub fn as_arg(self) -> &'static str {
        match self {
            CacheDtype::F32 => "f32",
            CacheDtype::Bf16 => "bf16",
            CacheDtype::F16 => "f16",
        }
    }
}

/// Service session affinity across replicas.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SessionAffinity {
    /// Every request to any ready replica.
    #[default]
    None,
    /// A client's requests to one replica (for three hours of quiet, the Kubernetes
    /// default), while it stays ready.
    #[serde(rename = "ClientIP")]
    ClientIp,
}

impl SessionAffinity {
    /// The Service's `sessionAffinity` value.
    pub fn as_str(self) -> &'static str {
        match self {
            SessionAffinity::None => "None",
            SessionAffinity::ClientIp => "ClientIP",
        }
    }
}

fn default_port() -> i32 {
    30000
}
fn default_served_model_name() -> String {
    "glm-5.3-flash".into()
}
fn default_context_length() -> u32 {
    131_072
}
fn default_max_batch_size() -> u32 {
    8
}
fn default_prefill_chunk() -> u32 {
    8192
}

impl Default for ServerSpec {
    fn default() -> Self {
        Self {
            port: default_port(),
            served_model_name: default_served_model_name(),
            context_length: default_context_length(),
            max_batch_size: default_max_batch_size(),
            prefill_chunk: default_prefill_chunk(),
            cache_dtype: CacheDtype::default(),
            api_key_secret: None,
            session_affinity: SessionAffinity::default(),
        }
    }
}

/// Prometheus and Grafana integration.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct MetricsSpec {
    /// Port of the server's `/metrics`; absent means the API port serves it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// Create a ServiceMonitor (needs the monitoring.coreos.com API).
    #[serde(default)]
    pub service_monitor: bool,
    /// Extra labels on the ServiceMonitor, for a Prometheus whose `serviceMonitorSelector`
    /// wants them (e.g. `release: kube-prometheus-stack`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub service_monitor_labels: BTreeMap<String, String>,
    /// Create a Grafana dashboard ConfigMap (label `grafana_dashboard: "1"`) for this server.
    #[serde(default)]
    pub dashboards: bool,
}

impl MetricsSpec {
    /// The port that serves `/metrics`.
    pub fn effective_port(&self, server: &ServerSpec) -> i32 {
        self.port.unwrap_or(server.port)
    }
}

/// Container image of glmflash-node.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ImageSpec {
    /// Image repository.
    #[serde(default = "default_image_repository")]
    #[schemars(length(min = 1, max = 255))]
    pub repository: String,
    /// Image tag; ignored when `digest` is set.
    #[serde(default = "default_image_tag")]
    #[schemars(length(min = 1, max = 128))]
    pub tag: String,
    /// Image digest (`sha256:...`), preferred over the tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^sha256:[a-f0-9]{64}$"))]
    pub digest: Option<String>,
    /// Pull policy.
    #[serde(default)]
    pub pull_policy: PullPolicy,
}

fn default_image_repository() -> String {
    "ghcr.io/glmflash/glmflash-node".into()
}
fn default_image_tag() -> String {
    env!("CARGO_PKG_VERSION").into()
}

impl Default for ImageSpec {
    fn default() -> Self {
        Self {
            repository: default_image_repository(),
            tag: default_image_tag(),
            digest: None,
            pull_policy: PullPolicy::default(),
        }
    }
}

impl ImageSpec {
    /// The image reference for a pod spec.
    pub fn reference(&self) -> String {
        match &self.digest {
            Some(digest) => format!("{}@{digest}", self.repository),
            None => format!("{}:{}", self.repository, self.tag),
        }
    }
}

/// Kubernetes image pull policy.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PullPolicy {
    /// Pull every start.
    Always,
    /// Pull when absent.
    #[default]
    IfNotPresent,
    /// Never pull.
    Never,
}

impl PullPolicy {
    /// The string a pod spec takes.
    pub fn as_str(self) -> &'static str {
        match self {
            PullPolicy::Always => "Always",
            PullPolicy::IfNotPresent => "IfNotPresent",
            PullPolicy::Never => "Never",
        }
    }
}

/// Observed state, written only by the operator.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GlmFlashDeploymentStatus {
    /// Coarse lifecycle phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// Ready servers over desired ones, as `kubectl get` shows them (`1/2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// NodeSelected, StoreReady, ServerReady and Ready, each with reason, message and
    /// observedGeneration.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Node of the first replica (`replicas` lists them all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// In-cluster base URL of the OpenAI API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Hash of the first replica's store inputs, that its current store was built from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_hash: Option<String>,
    /// Size of the packed store as reported by pack-store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_bytes: Option<u64>,
    /// Figures read from the first replica's `/metrics`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live: Option<LiveFigures>,
    /// Every replica the operator placed, by index, including those still draining after
    /// a scale-down and, while hibernated, where each will wake.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<ReplicaStatus>,
    /// When the operator last saw a replica serve or hold a completion request (or start
    /// serving); `spec.idleAfter` counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_request_time: Option<Time>,
}

/// One replica: its node, where it is, and its server's figures.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaStatus {
    /// Replica index, 0 to `spec.replicas - 1` (higher while draining).
    pub index: u32,
    /// Node its store and server live on.
    pub node: String,
    /// Where this replica is.
    pub phase: Phase,
    /// Why it is not serving, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Hash of the store inputs its store on the node was built from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_hash: Option<String>,
    /// Size of its packed store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_bytes: Option<u64>,
    /// Figures read from its server's `/metrics`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live: Option<LiveFigures>,
}

impl GlmFlashDeploymentStatus {
    /// The nodes whose GPU and memory cap this object holds: every replica's but a
    /// hibernated one's (an object written before replicas existed holds `node`).
    pub fn held_nodes(&self) -> Vec<&str> {
        if self.replicas.is_empty() {
            return match self.phase {
                Some(Phase::Hibernated) => Vec::new(),
                _ => self.node.as_deref().into_iter().collect(),
            };
        }
        self.replicas
            .iter()
            .filter(|r| r.phase != Phase::Hibernated)
            .map(|r| r.node.as_str())
            .collect()
    }
}

/// Live figures from the running server, rounded so that status changes only when they
/// do.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct LiveFigures {
    /// `glmflash_decode_tokens_per_second`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_tokens_per_second: Option<f64>,
    /// Share of expert lookups served by each tier (`vram`, `ram`, `nvme`), 0..1.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub hit_rate: BTreeMap<String, f64>,
    /// `glmflash_pin_failures_total`: RAM-tier memory the kernel refused to lock; above
    /// zero the RAM tier runs unpinned (slower uploads, pages may be swapped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pin_failures: Option<u64>,
    /// The memory plan the server runs with, as it reports it (`glmflash_plan_*`): the same
    /// numbers `glmflash-node plan` prints for that node's free VRAM and memory cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<PlanFigures>,
    /// Completion requests served since the server started (`glmflash_requests_total` of
    /// `/v1/chat/completions` and `/v1/completions`; probes and scrapes do not count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests: Option<u64>,
    /// Requests decoding or queued now (`glmflash_running_requests` plus
    /// `glmflash_waiting_requests`); absent when the last read of `/metrics` failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_requests: Option<u64>,
}

/// The server's memory plan: expert slots per tier (all MoE layers) and the store.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PlanFigures {
    /// Experts in VRAM slots (`glmflash_plan_expert_slots{tier="vram"}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vram_expert_slots: Option<u64>,
    /// Experts in pinned RAM slots (`glmflash_plan_expert_slots{tier="ram"}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_expert_slots: Option<u64>,
    /// Bytes of the packed store (`glmflash_plan_memory_bytes{kind="store"}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_bytes: Option<u64>,
}

/// Lifecycle phase.
#[derive(JsonSchema, Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The spec is invalid; see the Ready condition.
    Invalid,
    /// No node fits yet; see NodeSelected.
    Pending,
    /// The pack-store Job is running.
    PackingStore,
    /// The server is starting (loading weights).
    Starting,
    /// The server is ready.
    Running,
    /// Stuck until something changes: the pack-store Job failed after its retries, or the
    /// cluster refused an object or its pods (see Ready).
    Failed,
    /// The object is being deleted.
    Deleting,
    /// A replica's server is stopping after a scale-down; it holds its node until gone.
    Draining,
    /// Servers stopped and GPUs released; the stores and routing histories stay.
    Hibernated,
}

impl Phase {
    /// Name as written in status.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Invalid => "Invalid",
            Phase::Pending => "Pending",
            Phase::PackingStore => "PackingStore",
            Phase::Starting => "Starting",
            Phase::Running => "Running",
            Phase::Failed => "Failed",
            Phase::Deleting => "Deleting",
            Phase::Draining => "Draining",
            Phase::Hibernated => "Hibernated",
        }
    }
}

/// Condition types the operator maintains.
pub mod condition {
    /// A node was chosen.
    pub const NODE_SELECTED: &str = "NodeSelected";
    /// The packed store for the current inputs exists on that node.
    pub const STORE_READY: &str = "StoreReady";
    /// The server Deployment has a ready pod.
    pub const SERVER_READY: &str = "ServerReady";
    /// The server's memory plan fits the node (False: it refused, with the numbers, and the
    /// server is held at zero replicas until the spec changes).
    pub const PLAN_FITS: &str = "PlanFits";
    /// All of the above; clients can use the endpoint.
    pub const READY: &str = "Ready";
    /// Every type, in the order they are written.
    pub const ALL: [&str; 5] = [NODE_SELECTED, STORE_READY, SERVER_READY, PLAN_FITS, READY];
}

/// Why a spec is rejected.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SpecError {
    /// One of the CRD's CEL rules fails.
    #[error("{0}")]
    Rule(String),
    /// A check CEL cannot express.
    #[error("{field}: {message}")]
    Field {
        /// Spec field path.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

impl GlmFlashDeployment {
    /// Whether the object asks to hibernate, by spec or by [`HIBERNATE_ANNOTATION`].
    pub fn hibernating(&self) -> bool {
        self.spec.hibernate
            || self
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(HIBERNATE_ANNOTATION))
                .is_some_and(|v| v == "true")
    }

    /// `spec.idleAfter` as a duration; `None` when absent (or not a duration, which
    /// [`GlmFlashDeployment::validate`] reports).
    pub fn idle_after(&self) -> Option<Duration> {
        self.spec.idle_after.as_deref().and_then(parse_duration)
    }

    /// Every reason this object's spec cannot be served, CEL rules first. Empty means valid.
    pub fn validate(&self) -> Vec<SpecError> {
        let mut errors: Vec<SpecError> = match self.validate_cel() {
            Ok(()) => Vec::new(),
            Err(errs) => errs
                .into_vec()
                .into_iter()
                .map(|e| SpecError::Rule(e.to_string()))
                .collect(),
        };
        let spec = &self.spec;
        if let Some(slots) = spec.vram.expert_slots
            && slots > TOTAL_EXPERTS
        {
            errors.push(SpecError::Field {
                field: "vram.expertSlots",
                message: format!("{slots} exceeds the model's {TOTAL_EXPERTS} experts"),
            });
        }
        if spec.image.repository.trim().is_empty() {
            errors.push(SpecError::Field {
                field: "image.repository",
                message: "must not be empty".into(),
            });
        }
        if spec.placement.node_name.as_deref() == Some("") {
            errors.push(SpecError::Field {
                field: "placement.nodeName",
                message: "must not be empty when set".into(),
            });
        }
        errors
    }
}

/// A duration written as hours, minutes and seconds, each optional but in that order
/// (`90s`, `30m`, `1h30m`): the form `spec.idleAfter`'s CEL rule admits, also taken by the
/// activator's `--wake-timeout`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let mut rest = text;
    let mut seconds: u64 = 0;
    let mut last_unit = 0;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        let value: u64 = rest[..digits].parse().ok()?;
        let (unit, scale) = match rest[digits..].chars().next()? {
            'h' => (1, 3600),
            'm' => (2, 60),
            's' => (3, 1),
            _ => return None,
        };
        if unit <= last_unit {
            return None;
        }
        last_unit = unit;
        seconds = seconds.checked_add(value.checked_mul(scale)?)?;
        rest = &rest[digits + 1..];
    }
    Some(Duration::from_secs(seconds))
}

/// The CRD as YAML, exactly as checked in to [`CRD_FILE`] and the Helm chart.
pub fn crd_yaml() -> String {
    // Keys sorted at every level: the same YAML whether or not another crate in the build
    // turns on serde_json's `preserve_order` (which `cargo test --workspace` unifies in).
    let mut crd = serde_json::to_value(GlmFlashDeployment::crd()).expect("a CRD is JSON");
    drop_unknown_formats(&mut crd);
    crd.sort_all_objects();
    serde_yaml::to_string(&crd).expect("a CRD serializes to YAML")
}

/// Removes the `format`s schemars writes for unsigned integers (`uint32`, `uint64`): the
/// API server knows only `int32` and `int64` and warns about the rest on every install.
/// The ranges (`minimum`) still say the values are unsigned.
fn drop_unknown_formats(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            if map
                .get("format")
                .and_then(|f| f.as_str())
                .is_some_and(|f| f.starts_with("uint"))
            {
                map.remove("format");
            }
            map.values_mut().for_each(drop_unknown_formats);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(drop_unknown_formats),
        _ => {}
    }
}
