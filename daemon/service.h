/*
 * service.h - the daemon's services, on top of everything else: the
 * handlers of amaxd.v1.Calibration and grpc.health.v1.Health (service.c)
 * and of amaxd.peer.v1.Peer (service_peer.c), between the transport
 * (rpc.c, which knows them only as method tables and hooks) and the
 * registry, the coordinator and the calls to other daemons. Messages are
 * mapped to C with codec.h. Loop lock only.
 */
#ifndef AMX_SERVICE_H
#define AMX_SERVICE_H

#include "cluster.h"
#include "codec.h"
#include "coord.h"
#include "peer.h"
#include "registry.h"
#include "rpc.h"
#include "status.h"

typedef struct amx_shm amx_shm_t;

/* What the handlers work with (the transport's opaque context). */
struct amx_svc {
    amx_registry_t *reg;
    const amx_config_t *cfg;
    /* The cluster (NULL for a single daemon without a peer service):
     * identity and secret, the coordinator (rank 0 only), and the calls
     * to other daemons. */
    const amx_cluster_t *cluster;
    amx_coord_t *coord;
    amx_peer_t *peer;
    amx_shm_t *shm;    /* the packed form's shared buffers; NULL: off */
    uint32_t shm_max;  /* buffers at most (two descriptors each) */
    double start_time; /* CLOCK_MONOTONIC seconds at start */
    int stopping;      /* health answers NOT_SERVING once set */
    /* SendAmax/StreamAmax read in place: the updates and their names,
     * reused from request to request. */
    amx_codec_scratch_t scratch;
    /* The device doorbell's socket (doorbell.h), told to OpenDevice's
     * callers; "" when there is none. Set by main once it listens. */
    char doorbell[128];
};

/*
 * The services of this daemon: makes the shared-memory buffers of
 * cfg->shm_dir (a failure is fatal only when shm_dir was set explicitly),
 * hooks their cleanup to job drops, and, on the coordinator, tells the
 * participants of a job when one of its daemons restarted. `cluster`,
 * `coord` and `peer` may be NULL. Loop thread, at start.
 */
amx_status_t amx_service_create(const amx_config_t *cfg, amx_registry_t *reg,
                                const amx_cluster_t *cluster, amx_coord_t *coord, amx_peer_t *peer,
                                double start_time, amx_svc_t **out, amx_err_t *err);

/* What the transport serves: both method tables and the hooks (the peer
 * server only in a cluster of several daemons). */
void amx_service_serve(amx_svc_t *svc, amx_rpc_serve_t *out);

/* Frees it (after the registry, whose last drop hook closes buffers). */
void amx_service_free(amx_svc_t *svc);

/* The method tables (service.c, service_peer.c). */
extern const amx_method_t amx__methods[];
extern const size_t amx__n_methods;
extern const amx_method_t amx__peer_methods[];
extern const size_t amx__n_peer_methods;

/* The coordinator's word that daemon `restarted` of a job re-joined with
 * a new incarnation: the job's other participants drop communicator `gen`
 * (service_peer.c). */
void amx__service_on_restart(void *ud, const char *job, const amx_membership_t *m,
                             uint32_t restarted, uint64_t gen);

/* Frees the peer service's shared agreement answers (service_peer.c). */
void amx__service_peer_free(void);

/* Milliseconds of CLOCK_MONOTONIC. */
uint64_t amx__now_ms(void);

#endif
